"""The model runner: dispatch one scheduled step to the device, and collect its results.

It owns the weights, the paged KV cache (kv_cache.py) and the persistent InputBatch;
the programs a step runs, their precompile and caches live in programs.py, the
packing of a step's inputs in step_inputs.py and the sampler in sample/.

Per step it packs a SchedulerOutput into padded device inputs (one packed array), runs
the forward for the token bucket, which also gathers the last hidden state of every
request (in a bucket larger than max_num_seqs its last layer runs for those rows alone),
and samples on the device. A usual step is two dispatches (forward, then logits and
sampling in one program) and one host-to-device transfer (the packed inputs; the
sampling keys are made on the device; with LoRA on, the adapter slots too); exactly one
device-to-host transfer: the sampled ids (plus logprobs when asked).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import EngineConfig
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.distributed.dp_devices import core_devices
from jaxllm.distributed.mesh import make_mesh, put_replicated
from jaxllm.layers import row_reduce
from jaxllm.layers.attention import get_attention_backend
from jaxllm.layers.mlp import get_swiglu
from jaxllm.models.loader import load_model
from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.sampler import SamplerOutput
from jaxllm.worker.aot_cache import ExecutableCache
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.eagle_drafter import make_drafter
from jaxllm.worker.input_batch import InputBatch
from jaxllm.worker.kv_cache import engine_kv_cache, model_kv_groups
from jaxllm.worker.lora_slots import LoRASlots, lora_args
from jaxllm.worker.programs import (
    PROMPT_LOGPROBS_ROWS,
    StepPrograms,
    aot_context,
    bucket_compiler_options,
    enable_compilation_cache,
)
from jaxllm.worker.spec_verify import SpecVerifier, VerifyOutput
from jaxllm.worker.step_inputs import (
    StepInputs,
    prepare_step_inputs,
    prompt_logprobs_targets,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class StepHandle:
    """A dispatched step whose results are still (possibly) on the device."""

    req_ids: list[str]
    rows: np.ndarray  # InputBatch rows at dispatch
    layout_version: int  # InputBatch.layout_version at dispatch
    gen: np.ndarray  # [n] bool: a token is sampled for the request
    sampled: SamplerOutput | None  # ids padded to max_num_seqs rows, once sampled
    last_hidden: jax.Array  # [max_num_seqs, hidden]; the bucket's next forward takes it
    pool_indices: list[int]  # requests whose pooled state is due
    pool_normalize: list[tuple[bool, int | None]]  # (normalize, dimensions) of each
    prompt_lp: tuple | None  # (device (ids, logprobs, ranks), {req_id: slice})
    r_pad: int = 0  # the request bucket
    out_index: jax.Array | None = None  # the forward's output indices, for the sampler
    # Speculative decoding: (drafts per request, their counts, the verify forward's hidden
    # rows), and the verify sampler's output once dispatched.
    verify: tuple | None = None
    verified: VerifyOutput | None = None


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
        pc = config.parallel_config
        self.mesh = make_mesh(pc.tensor_parallel_size, core_devices(
            pc.tensor_parallel_size, pc.data_parallel_size, pc.data_parallel_rank))
        self.block_size = cc.block_size
        self.max_model_len = mc.max_model_len
        self.vocab_size = mc.vocab_size
        self.seed = mc.seed

        t0 = time.perf_counter()
        self.swiglu = get_swiglu(config.mlp_backend, config.mlp_interpret, dtype=self.dtype,
                                 mesh=self.mesh)
        model = load_model(mc, self.mesh, self.attn_backend, self.swiglu)
        self.row_reduce = row_reduce.attach(model, self.mesh)  # the row-parallel sums' route
        LoRASlots.attach(model, self.mesh, config.lora_config)  # adapter tables, if LoRA is on
        graphdef, state = nnx.split(model)
        # The weights as a flat list of arrays (see programs.step_functions).
        self.state = jax.tree.leaves(state)
        logger.info("loaded %s in %.1fs", mc.model, time.perf_counter() - t0)

        self.kv_groups = model_kv_groups(model)  # the scheduler's too (EngineCore)
        self.buckets = b = Buckets.make(sc.max_num_batched_tokens, sc.max_num_seqs,
                                        mc.max_model_len, cc.block_size, config.token_buckets,
                                        config.request_buckets, self.kv_groups.num_groups)
        # A draft model loads first (its weights are used memory); its cache mirrors ours.
        drafter = make_drafter(config, self.mesh, self.attn_backend, self.swiglu, b, model,
                               self.kv_groups)
        kv, self.num_kv_blocks = engine_kv_cache(  # the scheduler's block count (EngineCore)
            config, self.mesh, self.attn_backend, b, self.vocab_size, self.dtype,
            self.kv_groups, drafter.bytes_per_block() if drafter else 0, PROMPT_LOGPROBS_ROWS)
        self.kv_layout = kv  # layers, kv heads, head_dim, block size of the cache
        self.kv_cache = kv.allocate(self.num_kv_blocks)
        if drafter is not None:
            drafter.allocate(self.num_kv_blocks)
        self.input_batch = InputBatch(sc.max_num_seqs, mc.max_model_len, b.max_blocks_per_req,
                                      self.vocab_size, b.num_kv_groups)
        replicated = NamedSharding(self.mesh, P())
        self.input_batch.sampling.device_put = lambda x: put_replicated(x, replicated)
        self.wait_seconds = 0.0  # host time spent waiting for sampled tokens (benchmarks)
        self.dispatch_seconds = 0.0  # host time spent preparing and launching steps
        s = b.max_num_seqs
        self._arange = np.arange(s + 1, dtype=np.int32)
        self._rows_memo: tuple[int, list[str], np.ndarray] | None = None
        # The last dispatched step's sampled ids (device, [max_num_seqs]). Placed like the
        # sampler's output: the forward compiled with it then takes in-flight tokens.
        self._no_prev = put_replicated(np.zeros(s, np.int32), replicated)
        self._last_sampled = self._no_prev
        # On a CPU backend the outputs already sit in host memory: no early copy.
        self._copy_home = self.mesh.devices.flat[0].platform != "cpu"
        # Benchmarks set this to a list to get one StepRecord per executed step.
        self.step_log: list[StepRecord] | None = None
        context = aot_context(config, self.attn_backend, self.swiglu, self.mesh, self.row_reduce)
        aot = ExecutableCache.create(xla_cache_dir, context, list(self.mesh.devices.flat))
        capture = config.eagle_head and config.eagle_head.capture  # what a head reads
        self.programs = StepPrograms(graphdef, jax.tree.structure(state), model.logits_head[...],
                                     model.head_logits, b, aot, capture,
                                     bucket_compiler_options(config, self.mesh), replicated)
        self.lora = LoRASlots.create(model, self.state, config.lora_config, self.programs)
        # What a verify program is built from (spec_verify.py; benchmarks make their own).
        self.graph = (graphdef, jax.tree.structure(state), model.head_logits)
        spec = config.speculative_config
        self.spec = spec and SpecVerifier(spec, *self.graph, b, drafter, capture)

    @property
    def aot_cache(self) -> ExecutableCache | None:
        return self.programs.aot_cache

    def precompile(self) -> None:
        """Compiles every bucket now, so that serving never compiles."""
        self.kv_cache = self.programs.precompile(self.state, self.kv_cache, self._no_prev,
                                                 self.vocab_size, self.input_batch.sampling)
        if self.spec is not None:
            self.kv_cache = self.spec.precompile(
                self.state, self.programs.head, self.kv_cache, self.programs.dummy_inputs,
                self.vocab_size, self.input_batch.sampling.device_put, self.programs.lora_args)

    # ------------------------------------------------------------------- step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to finish (`dispatch` then `collect`)."""
        return self.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput, sample: bool = True) -> StepHandle | None:
        """Launches the step's forward and, unless `sample` is False, its sampler (then
        `dispatch_sample` launches it: the caller fills a token bitmask meanwhile)."""
        t0 = time.perf_counter()
        try:
            h = self._dispatch(so)
            if h is not None and sample:
                self._sample(h, so.grammar_bitmask)
            return h
        finally:
            self.dispatch_seconds += time.perf_counter() - t0

    def dispatch_sample(self, h: StepHandle | None, grammar_bitmask: np.ndarray | None) -> None:
        """The sampler of a step dispatched with `sample=False`."""
        t0 = time.perf_counter()
        if h is not None:
            self._sample(h, grammar_bitmask)
        self.dispatch_seconds += time.perf_counter() - t0

    def _dispatch(self, so: SchedulerOutput) -> StepHandle | None:
        """Prepares the step's inputs and launches its forward; returns without waiting.

        A scheduled token the host does not know yet (sampled by the step
        still in flight) is taken from that step's device output.
        """
        self._update_states(so)
        lora = self.lora.step_args(so) if self.lora else ()  # adapters' slots
        if so.total_num_scheduled_tokens == 0:
            return None
        ib = self.input_batch
        req_ids, nsched = so.req_ids, so.num_tokens
        n = len(req_ids)
        rows = self._rows_of(req_ids)
        drafts = so.scheduled_spec_decode_tokens
        verify = None
        if drafts:  # the drafts are the step's tokens past each request's known ones
            draft_lists = [drafts.get(r, []) for r in req_ids]
            num_drafts = np.fromiter(map(len, draft_lists), np.int32, n)
            ib.write_drafts(rows, draft_lists, num_drafts)
        inputs = prepare_step_inputs(ib, rows, nsched, self.buckets, self.block_size,
                                     self._arange)
        end = inputs.kv_lens
        if drafts:
            ib.num_tokens[rows] -= num_drafts
            verify = self.spec.verify_forward(self, inputs, rows, nsched, draft_lists,
                                              num_drafts)
            states = last_hidden = out_index = None
        else:
            prev_tokens = self._last_sampled if inputs.reads_prev else self._no_prev
            self.kv_cache, states, last_hidden, out_index, *captured = \
                self.programs.run_forward(self.state, self.kv_cache, inputs.packed,
                                          prev_tokens, *lora)
            if self.spec is not None:
                self.spec.follow(inputs.packed, None, *captured)
        prompt_lp = None
        # (A verify step scores no prompt: the scheduler drafts in no step that does.)
        if verify is None and ib.wants_prompt_logprobs[:ib.num_reqs].any():  # rare
            prompt_lp = self._dispatch_prompt_logprobs(req_ids, rows, nsched, inputs, states)
        # The scheduler decides which requests reach their end this step (a prompt
        # chunk that stops short of the prompt's end does not); of those, the
        # generating ones sample a token and the pooling ones are pooled.
        gen = so.samples & ib.generates[rows]
        if gen.all():  # every request samples: a decode step
            ib.inflight_index[rows] = self._arange[:n]
        else:
            ib.inflight_index[rows[gen]] = np.flatnonzero(gen)
        if self.step_log is not None:
            kv, q = end.astype(np.int64), nsched.astype(np.int64)
            self.step_log.append(StepRecord(inputs.num_tokens, inputs.padded_tokens, n,
                                            int(kv.sum()),
                                            int((q * kv - q * (q - 1) // 2).sum())))
        pool = (np.flatnonzero(ib.pools[rows] & so.samples).tolist()
                if ib.pools[:ib.num_reqs].any() else [])
        if pool and last_hidden is not None:  # a copy: the next forward takes the array
            last_hidden = jnp.copy(last_hidden)
        knobs = [(p.normalize, p.dimensions) for p in (ib.pooling[rows[i]] for i in pool)]
        return StepHandle(req_ids, rows, ib.layout_version, gen, None, last_hidden, pool,
                          knobs, prompt_lp, self.buckets.pad_requests(n), out_index, verify)

    def _sample(self, h: StepHandle, grammar_bitmask: np.ndarray | None) -> None:
        """Launches the sampler of a step whose forward is dispatched."""
        ib = self.input_batch
        rows = h.rows
        if ib.layout_version != h.layout_version:  # rows moved since the forward
            rows = self._rows_of(h.req_ids)
        if h.verify is not None:
            self.spec.dispatch_sample(self, h, rows, grammar_bitmask)
            return
        smd = ib.sampling.make_metadata(rows, h.r_pad, self.seed, h.out_index)
        if grammar_bitmask is not None:  # structured outputs: only then a bitmask copy
            smd = dataclasses.replace(smd, token_bitmask=self._pad_bitmask(grammar_bitmask,
                                                                          h.r_pad))
        out = h.sampled = self.programs.sample(h.last_hidden, smd)
        self._last_sampled = out.token_ids
        ib.sampling.record(rows, h.gen, out.token_ids, h.r_pad)  # outputs the sampler reads
        # Start the copies home now, so that they queue behind this step and
        # not behind the next one (dispatched before this step is collected).
        if self._copy_home:
            for arr in (out.token_ids, out.logprob_token_ids, out.logprobs, out.ranks):
                if arr is not None:
                    arr.copy_to_host_async()

    def collect(self, h: StepHandle | None) -> ModelRunnerOutput:
        """Waits for a dispatched step and records its sampled tokens on the host."""
        if h is None:
            return ModelRunnerOutput.empty()
        if self.spec is not None:
            return self.spec.collect(self, h)
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
        else:
            ib.append_sampled(rows[live], sampled[live])
        logprobs = None
        if out.logprobs is not None:
            logprobs = LogprobsLists(np.asarray(out.logprob_token_ids)[:n].tolist(),
                                     np.asarray(out.logprobs)[:n].tolist(),
                                     np.asarray(out.ranks)[:n].tolist())
        return ModelRunnerOutput(req_ids=h.req_ids, sampled_token_ids=None, logprobs=logprobs,
                                 prompt_logprobs=self._collect_prompt_logprobs(h.prompt_lp),
                                 pooler_output=self._pool(h),
                                 sampled_array=np.where(h.gen, sampled, -1))

    def _pad_bitmask(self, bitmask: np.ndarray, r_pad: int) -> np.ndarray:
        """The scheduler's `[n, words]` bitmask as the sampler takes it: `[r_pad,
        ceil(vocab / 32)]`, padding rows (and words past the vocabulary) all ones."""
        words = -(-self.vocab_size // 32)
        out = np.full((r_pad, words), -1, np.int32)
        w = min(words, bitmask.shape[1])
        out[:bitmask.shape[0], :w] = bitmask[:, :w]
        return out

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
        hidden = h.last_hidden
        if h.verify is not None:  # a verify step: position 0 is a pooled request's last token
            hidden = self.spec.first_rows(h.verify[2], np.zeros(self.buckets.max_num_seqs,
                                                                np.int32))[0]
        vecs = np.asarray(hidden, np.float32)[h.pool_indices]
        out = {}
        for v, i, (normalize, dim) in zip(vecs, h.pool_indices, h.pool_normalize, strict=True):
            v = v if dim is None else v[:dim]  # matryoshka dimensions
            if normalize:
                v = v / max(float(np.linalg.norm(v)), 1e-12)
            out[h.req_ids[i]] = v.tolist()
        return out

    def _dispatch_prompt_logprobs(self, req_ids: list[str], rows: np.ndarray,
                                  nsched: np.ndarray, inputs: StepInputs,
                                  states: jax.Array) -> tuple | None:
        pending = prompt_logprobs_targets(self.input_batch, req_ids, rows, nsched, inputs,
                                          states.shape[0])
        if pending is None:
            return None
        targets, spans = pending
        scored = self.programs.run_prompt_logprobs(self.state, self.kv_cache, inputs.packed,
                                                   states, targets, *lora_args(self.lora))
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
