"""The step's jitted programs, their precompilation, and the caches that keep them.

Compiled shapes (all made at start-up, see `StepPrograms.precompile`):
  forward[T]                       T in token buckets (attention metadata has
                                   max_num_seqs rows, so R does not matter)
  sample[R, mode]                  lm_head + draw for R requests (greedy,
                                   random, random with top-k/top-p)
  logits[R], then adjust / draw /  the staged sampler (sample/staged.py), for
  logprobs[R, variant]             steps with logits processors, a bitmask or logprobs
  output tables' flush / record[R] sample/output_state.py
  prompt_logprobs[T]               only when a request asks for prompt logprobs (with
                                   the last layer for every row where the forward ran
                                   it for the last rows alone)

Two caches keep them across restarts: JAX's persistent compilation cache
(`enable_compilation_cache`) and, for the forward and prompt-logprobs
programs, the serialized executables of aot_cache.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.config import EngineConfig, compilation_cache_dir
from jaxllm.layers.attention_backend import qkv_kernel_enabled, qkv_split_k
from jaxllm.layers.grouped_matmul import default_grouped_matmul
from jaxllm.layers.moe import small_step_kernel, small_token_limit
from jaxllm.layers.quant import fp8_weight_only_tokens, xla_compiler_options
from jaxllm.lora.layers import set_lora_masks
from jaxllm.sample.metadata import SamplingMetadata, variant_metadata
from jaxllm.sample.sampler import SamplerOutput, compute_prompt_logprobs_chunked
from jaxllm.sample.staged import STAGED, StagedSampler, draw_padded, is_plain
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.worker.aot_cache import ExecutableCache
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.sampling_rows import SamplingRows
from jaxllm.worker.step_inputs import pack_step_inputs, unpack_step_inputs

logger = logging.getLogger(__name__)

# Positions the prompt-logprobs program scores at once (compute_prompt_logprobs_chunked):
# its logits temporaries are [rows, vocab] in every token bucket, which the
# activation reserve then covers (scored in one pass, a large bucket of a
# 128K-vocabulary model needs gigabytes more than the reserve).
PROMPT_LOGPROBS_ROWS = 1024


def enable_compilation_cache(path: str | None) -> str:
    """JAX's persistent compilation cache, so a restart skips XLA compilation."""
    path = compilation_cache_dir(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Every executable, however quick to compile: a warm start then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def last_layer_on_rows(num_tokens: int, num_reqs: int) -> bool:
    """Whether a bucket's forward runs its last layer for the requests' last rows only
    (the model's `forward_rows`): where it has more tokens than request rows."""
    return num_tokens > num_reqs


# The forward's outputs after the KV cache that run_forward writes over the bucket's
# previous ones (states, last_hidden, out_index).
NUM_OUT_BUFS = 3


@functools.cache
def step_functions(graphdef: Any, state_def: Any, head_logits: Any, num_reqs: int,
                   width: int, num_groups: int = 1,
                   capture: tuple[int, ...] | None = None,
                   outputs_sharding: Any = None) -> tuple[Any, Any, Any, Any, Any]:
    """The jitted forward / sample / logits / prompt-logprobs for one model graph, and
    the forward's body unjitted (`forward_core`: its outputs' shapes).

    Cached per graph (and step-input layout) so that engines built on the same
    model in one process share compiled executables (the graph is closed over,
    not hashed per call). The weights come in as the flat list of the state's
    leaves (`state_def` is its tree structure): flattening an `nnx.State` on
    every call costs the host far more than passing a list. The logits and
    sampling steps take the head matrix alone (`head_logits(head, hidden)`,
    the model's): every array argument costs a dispatch. The prompt-logprobs
    step (rare) takes all the weights: it may run the last layer again. With
    `capture` (an EAGLE head's, `DecoderForCausalLM.forward_captured`) the forward
    also returns what the head reads of every row.

    The forward writes its first NUM_OUT_BUFS outputs over `out_bufs`, donated: the
    bucket's outputs of its previous run (run_forward), placed by `outputs_sharding`.
    XLA's command buffers hold every buffer's address, and an output that moves
    between runs (a step's outputs are still alive when the next step launches) makes
    XLA update the step's graph nodes before the launch; at a tensor-parallel decode
    step that host work outlasted the devices' (BENCHMARKS.md, Several GPUs). Over the
    donated buffers the outputs keep one address from run to run.
    """

    def on_rows(num_tokens: int) -> bool:
        # An EAGLE head reading final hidden states needs the last layer on every row.
        return capture != () and last_layer_on_rows(num_tokens, num_reqs)

    def merge(weights):
        return nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))

    def forward_core(weights, kv_cache, packed, prev_tokens, lora_slots=None):
        input_ids, positions, md, src, out_index = unpack_step_inputs(packed, num_reqs, width,
                                                                      num_groups)
        # Tokens sampled by the previous step that the host has not seen yet
        # (async scheduling) are read from its device output: src >= 0 names the row.
        input_ids = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], input_ids)
        # Every request's last scheduled token, the row its next token is sampled
        # from (padding requests end where the step's tokens end).
        rows = jnp.maximum(md.cu_q_lens[1:] - 1, 0)
        model = merge(weights)
        if lora_slots is not None:  # each request's adapter slot (-1: none)
            set_lora_masks(model, lora_slots, md.cu_q_lens, input_ids.shape[0])
        if capture is not None:
            last_hidden, kv_cache, states, target = model.forward_captured(
                input_ids, positions, kv_cache, md, rows, capture, on_rows(input_ids.shape[0]))
            return kv_cache, states, last_hidden, out_index, target
        if last_layer_on_rows(input_ids.shape[0], num_reqs):
            last_hidden, kv_cache, states = model.forward_rows(input_ids, positions, kv_cache,
                                                               md, rows)
        else:
            states, kv_cache = model(input_ids, positions, kv_cache, md)
            last_hidden = states[rows]
        # The sampler's output indices ride along, so that its keys need no host array.
        return kv_cache, states, last_hidden, out_index

    def logits(head, last_hidden, rows):
        return head_logits(head, last_hidden[:rows])

    def sample(head, last_hidden, md, size):
        return draw_padded(logits(head, last_hidden, md.temperature.shape[0]), md, size)

    def prompt_logprobs(weights, kv_cache, packed, states, targets, lora_slots=None):
        """Scores of `targets` at every row of a step, from the forward's `states` and cache."""
        model = merge(weights)
        hidden = states
        if on_rows(states.shape[0]):  # its last layer, for every row
            _, positions, md, _, _ = unpack_step_inputs(packed, num_reqs, width, num_groups)
            if lora_slots is not None:
                set_lora_masks(model, lora_slots, md.cu_q_lens, states.shape[0])
            hidden = model.finish_states(states, positions, kv_cache, md)
        head = model.logits_head[...]
        return compute_prompt_logprobs_chunked(lambda h: head_logits(head, h), hidden,
                                               targets, MAX_LOGPROBS, PROMPT_LOGPROBS_ROWS)

    return (writing_over(forward_core, outputs_sharding), jax.jit(sample, static_argnames="size"),
            jax.jit(logits, static_argnames="rows"), jax.jit(prompt_logprobs), forward_core)


def writing_over(forward_core: Callable, sharding: Any = None) -> Callable:
    """The jitted forward of `forward_core(weights, kv_cache, packed, prev_tokens,
    *extra)`: `forward(weights, kv_cache, packed, prev_tokens, out_bufs, *extra)`, the
    cache and `out_bufs` donated, its first NUM_OUT_BUFS outputs after the cache written
    over `out_bufs` (step_functions)."""
    def forward(weights, kv_cache, packed, prev_tokens, out_bufs, *extra):
        kv_cache, *outs = forward_core(weights, kv_cache, packed, prev_tokens, *extra)
        return (kv_cache, *write_over(out_bufs, outs, sharding))

    return jax.jit(forward, donate_argnums=(1, 4))


def write_over(out_bufs: tuple, values: list, sharding: Any = None) -> tuple:
    """`values` with the first `len(out_bufs)` written over `out_bufs` (donated): each
    buffer is read, so tracing keeps the argument and its donation aliases the value,
    but never selected; those values are placed by `sharding`."""
    def over(buf, value):
        value = jax.lax.select(jnp.zeros(value.shape, jnp.bool_), buf, value)
        return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)

    n = len(out_bufs)
    return (*map(over, out_bufs, values[:n]), *values[n:])


def out_buffer_specs(forward_core: Callable, args: tuple, sharding: Any
                     ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of `forward_core(*args)`'s outputs that the forward writes over its
    `out_bufs` (step_functions), placed by `sharding`."""
    outs = jax.eval_shape(forward_core, *args)[1:1 + NUM_OUT_BUFS]
    return tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sharding) for o in outs)


def aot_context(config: EngineConfig, attn_backend: Any, swiglu: Any,
                mesh: jax.sharding.Mesh, reduce: Any = None) -> dict[str, Any]:
    """What the traced forward depends on beyond its arguments' shapes (aot_cache.py);
    `reduce`: the model's row reduce (layers/row_reduce.py), if any."""
    mc = config.model_config
    hf = mc.hf_config
    to_dict = getattr(hf, "to_dict", None)
    return {"model": to_dict() if to_dict else vars(hf), "dtype": mc.dtype,
            # LongRoPE's factor set follows it (layers/rotary.py).
            "max_model_len": mc.max_model_len,
            "attention": [attn_backend.name, attn_backend.interpret],
            "mlp": [swiglu.name, swiglu.kernel, swiglu.interpret, swiglu.min_tokens],
            "mesh": [list(mesh.axis_names), list(mesh.devices.shape)],
            "lora": dataclasses.asdict(config.lora_config) if config.lora_config else None,
            # fp8 products switch to weight-only by row count (layers/quant.py).
            "fp8_weight_only_tokens": (fp8_weight_only_tokens()
                                       if (mc.quantization or "").startswith("fp8") else None),
            # Mixture-of-experts bodies chosen by environment knobs (layers/moe.py).
            "moe": [default_grouped_matmul(mesh).kernel, small_token_limit(mesh),
                    small_step_kernel(mesh)],
            # The GPU bodies' q/k norm, rotary and K/V write kernel, or XLA's ops.
            "qkv_kernel": qkv_kernel_enabled(),
            "qkv_split_k": qkv_split_k(),
            # The row-parallel sums' route and the peer kernel's sizes (layers/row_reduce.py).
            "row_reduce": reduce and reduce.cache_key(),
            # An EAGLE head's capture changes the forward's outputs (absent: none).
            **({"capture": list(head.capture)} if (head := config.eagle_head) else {})}


def bucket_compiler_options(config: EngineConfig, mesh: jax.sharding.Mesh
                            ) -> Callable[[int], dict[str, Any]]:
    """XLA's options for a token bucket's forward and prompt-logprobs programs, by its
    token count (layers/quant.py's `xla_compiler_options`)."""
    return functools.partial(xla_compiler_options, config.model_config.quantization,
                             platform=mesh.devices.flat[0].platform)


class StepPrograms:
    """One runner's programs: which executable runs each call, and their precompile.

    `executables` holds the forward and prompt-logprobs programs by (name,
    packed inputs' size), loaded from (or stored to) the disk cache at
    precompile; a bucket missing there runs through the jitted function.
    """

    def __init__(self, graphdef: Any, state_def: Any, head: jax.Array,
                 head_logits: Callable[..., jax.Array], buckets: Buckets,
                 aot_cache: ExecutableCache | None, capture: tuple[int, ...] | None = None,
                 compiler_options: Callable[[int], dict[str, Any]] = lambda rows: {},
                 outputs_sharding: Any = None):
        self.buckets = buckets
        # XLA options for a bucket's forward and prompt-logprobs programs, by its rows.
        self.compiler_options = compiler_options
        self.head = head  # the logits head, one of the weights (by reference)
        (self.forward, self.sample_fn, self.logits, self.prompt_logprobs,
         self.forward_core) = step_functions(
            graphdef, state_def, head_logits, buckets.max_num_seqs, buckets.max_blocks_per_req,
            buckets.num_kv_groups, capture, outputs_sharding)
        self.outputs_sharding = outputs_sharding
        # Each token bucket's forward outputs of its last run, written over by its next
        # (step_functions); and one bucket's output shapes, the others' by their rows.
        self._out_bufs: dict[int, tuple[jax.Array, ...]] = {}
        self._out_specs: tuple[jax.ShapeDtypeStruct, ...] | None = None
        self.aot_cache = aot_cache
        self.executables: dict[tuple[str, int], Any] = {}
        # The forward's and prompt-logprobs' extra argument with LoRA on: each
        # request's slot `[max_num_seqs]` (precompiled with none).
        self.lora_args: tuple = ()
        self.staged: StagedSampler = STAGED  # for steps `sample_fn` cannot take

    def run_forward(self, weights: Any, kv_cache: jax.Array, packed: Any,
                    prev_tokens: jax.Array, *lora: Any) -> tuple:
        """(kv_cache, states, last_hidden, out_index) of `forward(weights, kv_cache,
        packed, prev_tokens)`; the cache is donated, and so are the bucket's outputs of
        its previous run, whose arrays are deleted (step_functions)."""
        size = packed.shape[0]  # the packed inputs' size: one per token bucket
        bufs = self.out_buffers(weights, kv_cache, packed, prev_tokens, *lora)
        compiled = self.executables.get(("forward", size))
        outs = (compiled or self.forward)(weights, kv_cache, packed, prev_tokens, bufs, *lora)
        self._out_bufs[size] = tuple(outs[1:1 + NUM_OUT_BUFS])
        return outs

    def set_forward(self, forward_core: Callable) -> None:
        """Runs `forward_core` (step_functions' forward body) from now on in every bucket,
        writing over its outputs as the forward does (a benchmark's stand-in)."""
        self.forward = writing_over(forward_core, self.outputs_sharding)
        self.forward_core = forward_core
        self.executables = {k: v for k, v in self.executables.items() if k[0] != "forward"}
        self._out_bufs, self._out_specs = {}, None

    def out_buffers(self, weights: Any, kv_cache: jax.Array, packed: Any,
                    prev_tokens: jax.Array, *lora: Any, tokens: int | None = None
                    ) -> tuple[jax.Array, ...]:
        """The buffers the next forward of `packed`'s bucket writes its outputs over: its
        last run's outputs (taken: the run donates them), or zeros before its first.
        `tokens`, the bucket's (precompile): its shapes without tracing once another
        bucket's are known, as only the states' rows differ."""
        bufs = self._out_bufs.pop(packed.shape[0], None)
        if bufs is not None:
            return bufs
        if tokens is None or self._out_specs is None:
            specs = out_buffer_specs(self.forward_core, (
                weights, kv_cache, packed, prev_tokens, *lora), self.outputs_sharding)
            self._out_specs = self._out_specs or specs
        else:
            first = self._out_specs[0]
            specs = (first.update(shape=(tokens, *first.shape[1:])), *self._out_specs[1:])
        return tuple(jnp.zeros(s.shape, s.dtype, device=s.sharding) for s in specs)

    def run_prompt_logprobs(self, *args: Any) -> tuple:
        compiled = self.executables.get(("prompt_logprobs", args[2].shape[0]))
        return (compiled or self.prompt_logprobs)(*args)

    def sample(self, last_hidden: jax.Array, md: SamplingMetadata) -> SamplerOutput:
        """Logits of the step's requests and their next tokens, padded to max_num_seqs."""
        s = self.buckets.max_num_seqs
        if is_plain(md):
            return SamplerOutput(self.sample_fn(self.head, last_hidden, md, size=s))
        logits = self.logits(self.head, last_hidden, rows=md.temperature.shape[0])
        return self.staged(logits, md, s)

    def _load_or_compile(self, name: str, fn: Any, args: tuple, tokens: int,
                         **kw: Any) -> None:
        """Loads or compiles token bucket `tokens`' program `name` for `args`."""
        options = self.compiler_options(tokens)
        compiled = self.aot_cache and self.aot_cache.load_or_compile(
            name, fn, args, compiler_options=options, **kw)
        if compiled is None and options:  # the jitted call would compile without them
            compiled = fn.lower(*args).compile(compiler_options=options)
        if compiled is not None:
            self.executables[name, args[2].shape[0]] = compiled

    def dummy_inputs(self, t: int) -> np.ndarray:
        """The forward's packed integer inputs for a token bucket of `t` (no request)."""
        b = self.buckets
        return pack_step_inputs(t, b.max_num_seqs, b.max_blocks_per_req, b.num_kv_groups)[0]

    def precompile(self, state: list, kv_cache: jax.Array, no_prev: jax.Array,
                   vocab_size: int, sampling: SamplingRows) -> jax.Array:
        """Compiles every bucket now, so that serving never compiles; returns the KV
        cache (donated to each forward run). `sampling` is the runner's rows: its
        arrays' placement and its output tables are what the sampler then takes."""
        b = self.buckets
        jobs: list[tuple[str, Any]] = [("forward", t) for t in b.token_buckets]
        jobs += [("sample", r) for r in b.request_buckets]
        jobs += [("prompt_logprobs", t) for t in b.token_buckets]
        t0 = time.perf_counter()
        states, last_hidden, out_index = {}, None, None
        s = b.max_num_seqs
        # The output tables' programs first: the variants read the tables they make.
        sampling.outputs.precompile(b.request_buckets, no_prev)
        for kind, arg in tqdm(jobs, desc="Precompiling buckets", unit="shape",
                              disable=os.environ.get("JAXLLM_NO_PROGRESS") == "1"):
            if kind == "forward":
                args = (state, kv_cache, self.dummy_inputs(arg), no_prev)
                bufs = self.out_buffers(*args, *self.lora_args, tokens=arg)
                self._out_bufs[args[2].shape[0]] = bufs
                self._load_or_compile("forward", self.forward, (*args, bufs, *self.lora_args),
                                      arg, donate_argnums=(1, 4))
                kv_cache, states[arg], last_hidden, out_index, *_ = self.run_forward(
                    *args, *self.lora_args)
            elif kind == "sample":
                # The one-program sampler for each mode, then the staged one's parts.
                logits = self.logits(self.head, last_hidden, rows=arg)
                variants = list(variant_metadata(arg, vocab_size, sampling.device_put,
                                                 out_index, sampling.outputs.tables))
                for md in variants:
                    if is_plain(md):
                        self.sample_fn(self.head, last_hidden, md, size=s)
                self.staged.precompile(logits, variants, s)
            else:
                # Traced on a miss only: in buckets over max_num_seqs it runs the last
                # layer again, attention kernel included (finish_states).
                args = (state, kv_cache, self.dummy_inputs(arg), states[arg],
                        np.zeros(arg, np.int32), *self.lora_args)
                self._load_or_compile("prompt_logprobs", self.prompt_logprobs, args, arg)
                self.run_prompt_logprobs(*args)
        jax.block_until_ready(kv_cache)
        aot = self.aot_cache
        note = (f" (forward and prompt-logprobs programs: {aot.loaded} loaded from disk, "
                f"{aot.traced} traced)" if aot else "")
        logger.info("precompiled %d shapes in %.1fs%s", len(jobs), time.perf_counter() - t0, note)
        return kv_cache
