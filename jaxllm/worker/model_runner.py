"""The model runner: owns the weights, the paged KV cache, the bucketed jitted step.

Per step it turns a SchedulerOutput into padded device inputs (vectorized numpy
over the persistent InputBatch, one packed array), runs the forward for the
token bucket, which also gathers the last hidden state of every request (in a
bucket larger than max_num_seqs its last layer runs for those rows alone), and
samples on the device. A usual step is two dispatches (forward, then logits and
sampling in one program) and one host-to-device transfer (the packed inputs;
the sampling keys are made on the device); exactly one device-to-host transfer:
the sampled ids (plus logprobs when asked).

Compiled shapes (all made at start-up, see `precompile`):
  forward[T]                       T in token buckets (attention metadata has
                                   max_num_seqs rows, so R does not matter)
  sample[R, mode]                  lm_head + draw for R requests (greedy,
                                   random, random with top-k/top-p)
  logits[R], then adjust / draw /  the staged sampler, for steps with penalties,
  logprobs[R, variant]             logit adjustments or logprobs
  prompt_logprobs[T]               only when a request asks for prompt logprobs (with
                                   the last layer for every row where the forward ran
                                   it for the last rows alone)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxllm.config import EngineConfig, compilation_cache_dir
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.distributed.mesh import make_mesh
from jaxllm.engine.messages import LogprobsLists
from jaxllm.layers.attention import AttentionMetadata, get_attention_backend
from jaxllm.layers.mlp import get_swiglu
from jaxllm.models.loader import kv_cache_spec, load_model
from jaxllm.sample.metadata import SamplingMetadata, variant_metadata
from jaxllm.sample.sampler import (
    SamplerOutput,
    adjust_logits,
    compute_prompt_logprobs_chunked,
    draw,
    sampled_logprobs,
)
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.worker.aot_cache import ExecutableCache
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.input_batch import InputBatch
from jaxllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_CPU_DEFAULT_KV_BYTES = 1 << 30
# Positions the prompt-logprobs program scores at once (compute_prompt_logprobs_chunked):
# its logits temporaries are [rows, vocab] in every token bucket, which the
# activation reserve then covers (a 16384-token bucket scored in one pass needed
# ~8 GB more than the reserve on the 8B model and ran out of memory on an H100).
PROMPT_LOGPROBS_ROWS = 1024


def device_memory_total(platform: str, bytes_limit: int) -> int:
    """The device's whole memory, from its allocator's pool size.

    JAX's GPU allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of the device's
    memory (0.75 unless set; `import jaxllm` sets 0.95 where nothing else did);
    elsewhere the pool is the whole memory.
    """
    if platform != "gpu":
        return bytes_limit
    return int(bytes_limit / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))


def enable_compilation_cache(path: str | None) -> str:
    """JAX's persistent compilation cache, so a restart skips XLA compilation."""
    path = compilation_cache_dir(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Every executable, however quick to compile: a warm start then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def _draw_padded(logits: jax.Array, md: SamplingMetadata, size: int) -> jax.Array:
    """`draw`, padded to `size` rows: the next step's forward reads it by row."""
    token_ids = draw(logits, md)
    return jnp.zeros(size, jnp.int32).at[:token_ids.shape[0]].set(token_ids)


def _logprobs_padded(logits: jax.Array, token_ids: jax.Array) -> tuple:
    return sampled_logprobs(logits, token_ids[:logits.shape[0]], k=MAX_LOGPROBS)


# The sampler in three stages, jitted apart so that compiled variants add up
# (3 adjust + 3 draw + 1 logprobs per request bucket) instead of multiplying.
_jit_adjust = jax.jit(adjust_logits)
_jit_draw = jax.jit(_draw_padded, static_argnames="size")
_jit_logprobs = jax.jit(_logprobs_padded)


def _adjust_part(md: SamplingMetadata) -> SamplingMetadata | None:
    if md.penalties is None and md.logit_adjust is None:
        return None
    return dataclasses.replace(md, num_logprobs=0, all_greedy=False, use_top_k_top_p=False)


def is_plain(md: SamplingMetadata) -> bool:
    """No penalties, no logit adjustment, no logprobs: the step samples in one program."""
    return md.penalties is None and md.logit_adjust is None and not md.num_logprobs


def _draw_part(md: SamplingMetadata) -> SamplingMetadata:
    if is_plain(md):
        return md  # nothing to strip (a replace costs ~5 us)
    return dataclasses.replace(md, penalties=None, logit_adjust=None, num_logprobs=0)


def run_sampler(logits: jax.Array, md: SamplingMetadata, size: int) -> SamplerOutput:
    """The staged sampler: one token per row of `logits`, ids padded to `size`."""
    adj = _adjust_part(md)
    adjusted = logits if adj is None else _jit_adjust(logits, adj)
    token_ids = _jit_draw(adjusted, _draw_part(md), size=size)
    if not md.num_logprobs:
        return SamplerOutput(token_ids)
    return SamplerOutput(token_ids, *_jit_logprobs(logits, token_ids))


def pack_step_inputs(t_pad: int, num_reqs: int, width: int) -> tuple[np.ndarray, ...]:
    """The step's integer inputs in one host array, so that a step moves one buffer
    to the device and not nine (each transfer costs the host ~7 us on a CPU
    backend, ~60-90 us beside a GPU).

    Layout, flat int32: `req` [num_reqs, width + 4] (page table, then kv_lens,
    cu_q_lens[1:], num_seqs and the output index each request samples, in
    every row), then `tok` [4, t_pad] (input ids, positions, slot mapping,
    src: the row of the in-flight step's output that holds a token the host
    has not seen, -1 none). Returns it zeroed (src -1), with writable views:
    (packed, input_ids, positions, slots, src, page_indices, kv_lens, cu_end,
    num_seqs, out_index).
    """
    split = num_reqs * (width + 4)
    packed = np.zeros(split + 4 * t_pad, np.int32)
    req = packed[:split].reshape(num_reqs, width + 4)
    tok = packed[split:].reshape(4, t_pad)
    tok[3] = -1
    return (packed, tok[0], tok[1], tok[2], tok[3], req[:, :width], *req[:, width:].T)


def unpack_step_inputs(packed: jax.Array, num_reqs: int, width: int) -> tuple:
    """(input_ids, positions, AttentionMetadata, src, out_index) from `pack_step_inputs`'
    array."""
    split = num_reqs * (width + 4)
    req = packed[:split].reshape(num_reqs, width + 4)
    tok = packed[split:].reshape(4, -1)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), req[:, width + 1]])
    md = AttentionMetadata(slot_mapping=tok[2], kv_lens=req[:, width],
                           page_indices=req[:, :width], cu_q_lens=cu,
                           num_seqs=req[:1, width + 2])
    return tok[0], tok[1], md, tok[3], req[:, width + 3]


def last_layer_on_rows(num_tokens: int, num_reqs: int) -> bool:
    """Whether a bucket's forward runs its last layer for the requests' last rows only
    (the model's `forward_rows`): where it has more tokens than request rows."""
    return num_tokens > num_reqs


@functools.cache
def _step_functions(graphdef: Any, state_def: Any, head_logits: Any, num_reqs: int,
                    width: int) -> tuple[Any, Any, Any, Any]:
    """The jitted forward / sample / logits / prompt-logprobs for one model graph.

    Cached per graph (and step-input layout) so that engines built on the same
    model in one process share compiled executables (the graph is closed over,
    not hashed per call). The weights come in as the flat list of the state's
    leaves (`state_def` is its tree structure): flattening an `nnx.State` on
    every call costs the host ~0.7 ms for a 32-layer model, a list next to
    nothing. The logits and sampling steps take the head matrix alone
    (`head_logits(head, hidden)`, the model's): every array argument costs a
    dispatch ~1 us. The prompt-logprobs step (rare) takes all the weights: it may
    run the last layer again.
    """

    def merge(weights):
        return nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))

    def forward(weights, kv_cache, packed, prev_tokens):
        input_ids, positions, md, src, out_index = unpack_step_inputs(packed, num_reqs, width)
        # Tokens sampled by the previous step that the host has not seen yet
        # (async scheduling) are read from its device output: src >= 0 names the row.
        input_ids = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], input_ids)
        # Every request's last scheduled token, the row its next token is sampled
        # from (padding requests end where the step's tokens end).
        rows = jnp.maximum(md.cu_q_lens[1:] - 1, 0)
        model = merge(weights)
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
        return _draw_padded(logits(head, last_hidden, md.temperature.shape[0]), md, size)

    def prompt_logprobs(weights, kv_cache, packed, states, targets):
        """Scores of `targets` at every row of a step, from the forward's `states` and cache."""
        model = merge(weights)
        hidden = states
        if last_layer_on_rows(states.shape[0], num_reqs):  # its last layer, for every row
            _, positions, md, _, _ = unpack_step_inputs(packed, num_reqs, width)
            hidden = model.finish_states(states, positions, kv_cache, md)
        head = model.logits_head[...]
        return compute_prompt_logprobs_chunked(lambda h: head_logits(head, h), hidden,
                                               targets, MAX_LOGPROBS, PROMPT_LOGPROBS_ROWS)

    return (jax.jit(forward, donate_argnums=(1,)), jax.jit(sample, static_argnames="size"),
            jax.jit(logits, static_argnames="rows"), jax.jit(prompt_logprobs))


@dataclasses.dataclass
class StepHandle:
    """A dispatched step whose results are still (possibly) on the device."""

    req_ids: list[str]
    rows: np.ndarray  # InputBatch rows at dispatch
    layout_version: int  # InputBatch.layout_version at dispatch
    gen: np.ndarray  # [n] bool: a token is sampled for the request
    sampled: SamplerOutput  # token ids padded to max_num_seqs rows
    last_hidden: jax.Array  # [max_num_seqs, hidden]: row i, request i's last token
    pool_indices: list[int]  # requests whose pooled state is due
    pool_normalize: list[bool]
    prompt_lp: tuple | None  # (device (ids, logprobs, ranks), {req_id: slice})


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step computed, for rooflines and padding-waste reports."""

    num_tokens: int
    padded_tokens: int
    num_reqs: int
    kv_tokens: int  # sum of context lengths read by attention
    attn_pairs: int  # sum over requests of (query, key) pairs under the causal mask


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.attn_backend = get_attention_backend(config.attention_backend,
                                                  config.attention_interpret)
        xla_cache_dir = enable_compilation_cache(config.compilation_cache_dir)
        self.dtype = _DTYPES[mc.dtype]
        self.mesh = make_mesh(config.parallel_config.tensor_parallel_size,
                              config.parallel_config.data_parallel_size)
        self.block_size = cc.block_size
        self.max_model_len = mc.max_model_len
        self.vocab_size = mc.vocab_size
        self.seed = mc.seed

        t0 = time.perf_counter()
        self.swiglu = get_swiglu(config.mlp_backend, config.mlp_interpret, dtype=self.dtype,
                                 mesh=self.mesh)
        model = load_model(mc, self.mesh, self.attn_backend, self.swiglu)
        self._head = model.logits_head[...]  # one of the weights, by reference
        self._head_logits = type(model).head_logits
        self.graphdef, state = nnx.split(model)
        # The weights as a flat list of arrays (see _step_functions).
        self.state_def = jax.tree.structure(state)
        self.state = jax.tree.leaves(state)
        logger.info("loaded %s in %.1fs", mc.model, time.perf_counter() - t0)

        self.buckets = Buckets.make(sc.max_num_batched_tokens, sc.max_num_seqs, mc.max_model_len,
                                    cc.block_size, config.token_buckets, config.request_buckets)
        self.num_layers, self.num_kv_heads, self.head_dim = kv_cache_spec(
            mc.hf_config, self.mesh.shape["model"])
        cc.num_blocks = self._num_kv_blocks()
        self.kv_cache = self._allocate_kv_cache(cc.num_blocks)
        self.input_batch = InputBatch(sc.max_num_seqs, mc.max_model_len,
                                      self.buckets.max_blocks_per_req, self.vocab_size)
        replicated = NamedSharding(self.mesh, P())
        self.input_batch.sampling.device_put = lambda x: jax.device_put(x, replicated)
        self.wait_seconds = 0.0  # host time spent waiting for sampled tokens (benchmarks)
        self.dispatch_seconds = 0.0  # host time spent preparing and launching steps
        s = self.buckets.max_num_seqs
        self._arange = np.arange(s + 1, dtype=np.int32)
        self._rows_memo: tuple[int, list[str], np.ndarray] | None = None
        # The last dispatched step's sampled ids (device, [max_num_seqs]).
        # Placed like the sampler's output, so that the forward compiled with
        # it at start-up is the one that later takes in-flight tokens.
        self._no_prev = jax.device_put(np.zeros(s, np.int32), NamedSharding(self.mesh, P()))
        self._last_sampled = self._no_prev
        # On a CPU backend the outputs already sit in host memory: no early copy.
        self._copy_home = self.mesh.devices.flat[0].platform != "cpu"
        # Benchmarks set this to a list to get one StepRecord per executed step.
        self.step_log: list[StepRecord] | None = None
        self._build_functions()
        # Compiled forward and prompt-logprobs programs by (name, packed inputs' size),
        # loaded from (or stored to) the disk cache at precompile; a bucket missing
        # here runs through the jitted function.
        self._exec: dict[tuple[str, int], Any] = {}
        self.aot_cache = ExecutableCache.create(
            xla_cache_dir, self._aot_context(), list(self.mesh.devices.flat))

    # ------------------------------------------------------------------ set-up

    def _kv_bytes_per_block(self) -> int:
        shape = self.attn_backend.kv_cache_shape(1, self.block_size, self.num_kv_heads,
                                                 self.head_dim)
        return int(np.prod(shape)) * jnp.dtype(self.dtype).itemsize * self.num_layers

    def _num_kv_blocks(self) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_block = self._kv_bytes_per_block()
        if cc.num_kv_blocks:
            return int(cc.num_kv_blocks) + 1  # + the reserved null block
        budget = cc.kv_cache_bytes
        device = self.mesh.devices.flat[0]
        if budget is None and device.platform != "cpu":
            stats = device.memory_stats() or {}
            limit, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
            # hbm_utilization is a share of the device's whole memory, as vLLM's
            # gpu_memory_utilization; the allocator's pool may be smaller.
            total = device_memory_total(device.platform, limit)
            budget = min(int(total * cc.hbm_utilization), limit) - used
            budget -= self._activation_reserve()
            budget *= self.mesh.shape["model"]  # the cache is sharded over kv heads
        if budget is None:
            # CPU: room for every sequence at full length, capped.
            want = sc.max_num_seqs * (-(-self.max_model_len // self.block_size)) * per_block
            budget = min(want, _CPU_DEFAULT_KV_BYTES)
        num_blocks = int(budget // per_block)
        if num_blocks < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block "
                             f"({per_block} bytes each): raise hbm_utilization or kv_cache_bytes")
        tokens = (num_blocks - 1) * self.block_size
        logger.info("KV cache: %d blocks, %d tokens (%.2f GiB); %.1f sequences of "
                    "max_model_len %d fit at once", num_blocks - 1, tokens,
                    num_blocks * per_block / 2**30, tokens / self.max_model_len,
                    self.max_model_len)
        return num_blocks

    def _activation_reserve(self) -> int:
        """A generous bound on the step's transient memory (activations + logits)."""
        hf = self.config.model_config.hf_config
        t = self.buckets.token_buckets[-1]
        r = self.buckets.request_buckets[-1]
        inter = int(getattr(hf, "intermediate_size", 4 * hf.hidden_size))
        act = t * (4 * hf.hidden_size + 3 * inter) * jnp.dtype(self.dtype).itemsize
        # Sampling's logits (r rows) or the prompt-logprobs chunk's, float32, with copies.
        logits = max(r, min(t, PROMPT_LOGPROBS_ROWS)) * self.vocab_size * 4 * 6
        return int(2 * act + logits + (256 << 20))

    def _allocate_kv_cache(self, num_blocks: int) -> jax.Array:
        """One array for every layer's pages: layer l's block b is page l * num_blocks + b."""
        from jaxllm.distributed.mesh import kv_cache_sharding

        shape = self.attn_backend.kv_cache_shape(self.num_layers * num_blocks, self.block_size,
                                                 self.num_kv_heads, self.head_dim)
        sharding = kv_cache_sharding(self.mesh, self.attn_backend)
        return jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=sharding)()

    def _build_functions(self) -> None:
        fns = _step_functions(self.graphdef, self.state_def, self._head_logits,
                              self.buckets.max_num_seqs, self.buckets.max_blocks_per_req)
        self._forward, self._sample_fn, self._logits, self._prompt_logprobs = fns

    def _aot_context(self) -> dict[str, Any]:
        """What the traced forward depends on beyond its arguments' shapes (aot_cache.py)."""
        mc = self.config.model_config
        hf = mc.hf_config
        to_dict = getattr(hf, "to_dict", None)
        return {"model": to_dict() if to_dict else vars(hf), "dtype": mc.dtype,
                "attention": [self.attn_backend.name, self.attn_backend.interpret],
                "mlp": [self.swiglu.name, self.swiglu.kernel, self.swiglu.interpret,
                        self.swiglu.min_tokens],
                "mesh": [list(self.mesh.axis_names), list(self.mesh.devices.shape)]}

    def _run_forward(self, *args: Any) -> tuple:
        compiled = self._exec.get(("forward", args[2].shape[0]))
        return (compiled or self._forward)(*args)

    def _run_prompt_logprobs(self, *args: Any) -> tuple:
        compiled = self._exec.get(("prompt_logprobs", args[2].shape[0]))
        return (compiled or self._prompt_logprobs)(*args)

    def _load_or_compile(self, name: str, fn: Any, args: tuple, **kw: Any) -> None:
        compiled = self.aot_cache and self.aot_cache.load_or_compile(name, fn, args, **kw)
        if compiled is not None:
            self._exec[name, args[2].shape[0]] = compiled

    def _sample(self, last_hidden: jax.Array, md: SamplingMetadata) -> SamplerOutput:
        """Logits of the step's requests and their next tokens, padded to max_num_seqs."""
        s = self.buckets.max_num_seqs
        if is_plain(md):
            return SamplerOutput(self._sample_fn(self._head, last_hidden, md, size=s))
        logits = self._logits(self._head, last_hidden, rows=md.temperature.shape[0])
        return run_sampler(logits, md, s)

    # ------------------------------------------------------------- precompile

    def precompile(self) -> None:
        """Compiles every bucket now, so that serving never compiles."""
        b = self.buckets
        jobs: list[tuple[str, Any]] = [("forward", t) for t in b.token_buckets]
        jobs += [("sample", r) for r in b.request_buckets]
        jobs += [("prompt_logprobs", t) for t in b.token_buckets]
        t0 = time.perf_counter()
        states, last_hidden, out_index = {}, None, None
        s = b.max_num_seqs
        for kind, arg in tqdm(jobs, desc="Precompiling buckets", unit="shape",
                              disable=os.environ.get("JAXLLM_NO_PROGRESS") == "1"):
            if kind == "forward":
                args = (self.state, self.kv_cache, self._dummy_inputs(arg), self._no_prev)
                self._load_or_compile("forward", self._forward, args, donate_argnums=(1,))
                self.kv_cache, states[arg], last_hidden, out_index = self._run_forward(*args)
            elif kind == "sample":
                # The one-program sampler for each mode, then the staged one's parts.
                logits = self._logits(self._head, last_hidden, rows=arg)
                seen = set()
                for md in variant_metadata(arg, self.vocab_size,
                                           self.input_batch.sampling.device_put, out_index):
                    if is_plain(md):
                        self._sample_fn(self._head, last_hidden, md, size=s)
                    for fn, part in ((_jit_adjust, _adjust_part(md)), (_jit_draw, _draw_part(md))):
                        key = (fn, jax.tree_util.tree_structure(part))
                        if part is not None and key not in seen:
                            seen.add(key)
                            out = (fn(logits, part) if fn is _jit_adjust else
                                   fn(logits, part, size=s))
                _jit_logprobs(logits, out)  # `out`: token ids of the last draw
            else:
                # Traced on a miss only: in buckets over max_num_seqs it runs the last
                # layer again, attention kernel included (finish_states).
                args = (self.state, self.kv_cache, self._dummy_inputs(arg), states[arg],
                        np.zeros(arg, np.int32))
                self._load_or_compile("prompt_logprobs", self._prompt_logprobs, args)
                self._run_prompt_logprobs(*args)
        jax.block_until_ready(self.kv_cache)
        aot = self.aot_cache
        note = (f" (forward and prompt-logprobs programs: {aot.loaded} loaded from disk, "
                f"{aot.traced} traced)" if aot else "")
        logger.info("precompiled %d shapes in %.1fs%s", len(jobs), time.perf_counter() - t0, note)

    def _dummy_inputs(self, t: int) -> np.ndarray:
        """The forward's packed integer inputs for a token bucket of `t` (no request)."""
        return pack_step_inputs(t, self.buckets.max_num_seqs, self.buckets.max_blocks_per_req)[0]

    # ------------------------------------------------------------------- step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to finish (`dispatch` then `collect`)."""
        return self.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput) -> StepHandle | None:
        t0 = time.perf_counter()
        try:
            return self._dispatch(so)
        finally:
            self.dispatch_seconds += time.perf_counter() - t0

    def _dispatch(self, so: SchedulerOutput) -> StepHandle | None:
        """Prepares the step's inputs and launches it; returns without waiting.

        A scheduled token the host does not know yet (sampled by the step
        still in flight) is taken from that step's device output.
        """
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return None
        ib = self.input_batch
        req_ids, nsched = so.req_ids, so.num_tokens
        n = len(req_ids)
        rows = self._rows_of(req_ids)
        t_real = int(nsched.sum())
        t_pad = self.buckets.pad_tokens(t_real)
        r_pad = self.buckets.pad_requests(n)
        s, bs = self.buckets.max_num_seqs, self.block_size

        # Vectorized input preparation over the persistent rows, written into
        # the packed array the forward takes. Padding tokens write slot 0
        # (the null block); padding requests have no tokens and no KV.
        (packed, input_ids, positions, slots, src, page_indices, kv_lens, cu_end, num_seqs,
         out_idx) = pack_step_inputs(t_pad, s, self.buckets.max_blocks_per_req)
        computed = ib.num_computed_tokens[rows]
        pos = positions[:t_real]
        if t_real == n:  # one token per request (decode): token i belongs to request i
            cu, first = self._arange[1:n + 1], self._arange[:n]
            pos[:] = computed
            tok_rows = rows
        else:
            cu = np.cumsum(nsched)
            req_of_tok = np.repeat(self._arange[:n], nsched)
            first = cu - nsched
            pos[:] = computed[req_of_tok] + (np.arange(t_real) - first[req_of_tok])
            tok_rows = rows[req_of_tok]
        cu_end[:n] = cu
        cu_end[n:] = t_real
        num_seqs[:] = n
        input_ids[:t_real] = ib.token_ids[tok_rows, np.minimum(pos, self.max_model_len - 1)]
        unknown = pos >= ib.num_tokens[tok_rows]
        prev_tokens = self._no_prev
        if unknown.any():
            src[:t_real][unknown] = ib.inflight_index[tok_rows[unknown]]
            if (src[:t_real][unknown] < 0).any():
                raise RuntimeError("a scheduled token is neither known nor in flight")
            prev_tokens = self._last_sampled
        slots[:t_real] = ib.block_table[tok_rows, pos // bs] * bs + pos % bs
        kv_lens[:n] = end = computed + nsched
        page_indices[:n] = ib.block_table[rows]
        out_idx[:n] = np.maximum(end - ib.num_prompt_tokens[rows], 0)

        self.kv_cache, states, last_hidden, out_index = self._run_forward(
            self.state, self.kv_cache, packed, prev_tokens)
        # A prompt chunk that stops short of the prompt's end samples nothing.
        done = end >= ib.num_tokens[rows] + ib.num_pending[rows]
        smd = ib.sampling.make_metadata(rows, r_pad, self.seed, out_index)
        out = self._sample(last_hidden, smd)
        prompt_lp = None
        if ib.wants_prompt_logprobs[:ib.num_reqs].any():  # none for most steps
            prompt_lp = self._dispatch_prompt_logprobs(req_ids, rows, nsched, computed, first,
                                                       packed, states)
        ib.num_computed_tokens[rows] = end
        gen = done & ib.samples[rows]
        if gen.all():  # every request samples: a decode step
            ib.inflight_index[rows] = self._arange[:n]
            ib.num_pending[rows] += 1
        else:
            ib.inflight_index[rows[gen]] = np.flatnonzero(gen)
            ib.num_pending[rows[gen]] += 1
        self._last_sampled = out.token_ids
        # Start the copies home now, so that they queue behind this step and
        # not behind the next one (dispatched before this step is collected).
        if self._copy_home:
            for arr in (out.token_ids, out.logprob_token_ids, out.logprobs, out.ranks):
                if arr is not None:
                    arr.copy_to_host_async()
        if self.step_log is not None:
            kv = kv_lens[:n].astype(np.int64)
            q = nsched.astype(np.int64)
            self.step_log.append(StepRecord(t_real, t_pad, n, int(kv.sum()),
                                            int((q * kv - q * (q - 1) // 2).sum())))
        pool = (np.flatnonzero(ib.pools[rows] & done).tolist() if ib.pools[:ib.num_reqs].any()
                else [])
        return StepHandle(req_ids, rows, ib.layout_version, gen, out, last_hidden, pool,
                          [ib.pooling[rows[i]].normalize for i in pool], prompt_lp)

    def collect(self, h: StepHandle | None) -> ModelRunnerOutput:
        """Waits for a dispatched step and records its sampled tokens on the host."""
        if h is None:
            return ModelRunnerOutput.empty()
        ib, n, out = self.input_batch, len(h.req_ids), h.sampled
        t0 = time.perf_counter()
        sampled = np.asarray(out.token_ids)[:n]
        self.wait_seconds += time.perf_counter() - t0
        # Rows as they are now: a request may have moved, or left (finished,
        # preempted) while the step ran.
        rows = h.rows
        if ib.layout_version != h.layout_version:
            rows = np.fromiter((ib.req_id_to_row.get(r, -1) for r in h.req_ids), np.int32, n)
        live = h.gen & (rows >= 0)
        if live.all():  # a decode step's usual case
            ib.append_sampled(rows, sampled)
            ib.num_pending[rows] -= 1
        else:
            ib.append_sampled(rows[live], sampled[live])
            ib.num_pending[rows[live]] -= 1
        logprobs = None
        if out.logprobs is not None:
            logprobs = LogprobsLists(np.asarray(out.logprob_token_ids)[:n].tolist(),
                                     np.asarray(out.logprobs)[:n].tolist(),
                                     np.asarray(out.ranks)[:n].tolist())
        return ModelRunnerOutput(req_ids=h.req_ids, sampled_token_ids=None, logprobs=logprobs,
                                 prompt_logprobs=self._collect_prompt_logprobs(h.prompt_lp),
                                 pooler_output=self._pool(h),
                                 sampled_array=np.where(h.gen, sampled, -1))

    def _rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The persistent rows of `req_ids` (read-only). A decode step asks for the same
        ids as the step before, twice per step; while no row moved, that answer stands."""
        ib, memo = self.input_batch, self._rows_memo
        if memo is not None and memo[0] == ib.layout_version and memo[1] == req_ids:
            return memo[2]
        rows = np.fromiter(map(ib.req_id_to_row.__getitem__, req_ids), np.int32, len(req_ids))
        rows.flags.writeable = False
        self._rows_memo = (ib.layout_version, list(req_ids), rows)
        return rows

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            ib.remove(req_id)
        for new in so.scheduled_new_reqs:
            ib.remove(new.req_id)  # a resumed request is rebuilt from scratch
            ib.add(new)
        cached = so.scheduled_cached_reqs
        if not cached.req_ids:
            return
        rows = self._rows_of(cached.req_ids)
        ib.num_computed_tokens[rows] = cached.num_computed_tokens
        # Only the few requests that got blocks (a decode step: ~1 in 16) reach Python.
        for row, blocks in itertools.compress(zip(rows.tolist(), cached.new_block_ids,
                                                  strict=True), cached.new_block_ids):
            ib.append_blocks(row, blocks)

    def _pool(self, h: StepHandle) -> dict[str, list[float]]:
        """Last-token pooling for embedding requests whose prompt is complete."""
        if not h.pool_indices:
            return {}
        # Rare path: one host copy of the step's hidden states, no extra compilation.
        vecs = np.asarray(h.last_hidden, np.float32)[h.pool_indices]
        out = {}
        for v, i, normalize in zip(vecs, h.pool_indices, h.pool_normalize, strict=True):
            if normalize:
                v = v / max(float(np.linalg.norm(v)), 1e-12)
            out[h.req_ids[i]] = v.tolist()
        return out

    def _dispatch_prompt_logprobs(self, req_ids, rows, nsched, computed, first, packed,
                                  states) -> tuple | None:
        ib = self.input_batch
        spans = {}
        targets = np.zeros(states.shape[0], np.int32)
        for i in np.flatnonzero(ib.wants_prompt_logprobs[rows]):
            # Positions [start, stop) of this step's tokens for the request (a
            # resumed request skips those scored before its preemption).
            row = rows[i]
            start = max(computed[i], ib.prompt_logprobs_from[row])
            stop = min(computed[i] + nsched[i], ib.num_prompt_tokens[row] - 1)
            if start >= stop:
                continue
            at = first[i] + start - computed[i]  # in the step's tokens
            targets[at:at + stop - start] = ib.token_ids[row, start + 1:stop + 1]
            spans[req_ids[i]] = slice(at, at + stop - start)
        if not spans:
            return None
        scored = self._run_prompt_logprobs(self.state, self.kv_cache, packed, states, targets)
        return scored, spans

    @staticmethod
    def _collect_prompt_logprobs(pending: tuple | None) -> dict[str, LogprobsLists]:
        if pending is None:
            return {}
        arrays, spans = pending
        ids, lps, ranks = (np.asarray(a) for a in arrays)
        return {req_id: LogprobsLists(ids[sl].tolist(), lps[sl].tolist(), ranks[sl].tolist())
                for req_id, sl in spans.items()}

    # ------------------------------------------------------------------ misc

    @functools.cached_property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes
