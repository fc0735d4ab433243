"""The model runner of an encoder-only model (BERT, RoBERTa and their cross-encoders): whole
prompts in, pooled vectors or classifier outputs out.

The scheduler hands it new requests only, each with its whole prompt (an
encoder keeps no KV cache, so nothing is chunked or resumed). One step packs
the prompts into a flat token batch padded to a token bucket, every request
one segment of a segment-masked bidirectional attention, and runs one jitted
program per token bucket that encodes and pools (mean, CLS or last token, as
the checkpoint's pooling config says) into `[max_num_seqs, hidden]` float32
rows; a cross-encoder's program pools the first token and runs its head into
`[max_num_seqs, num_labels]` logits. On the host, from the rows that come back
(one device-to-host copy per step): an embedding's truncation to `dimensions`
and normalization, a classification's or a score's activation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.config import EngineConfig
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.distributed.dp_devices import core_devices
from jaxllm.distributed.mesh import make_mesh
from jaxllm.layers.attention import get_attention_backend
from jaxllm.layers.precision import products_at
from jaxllm.models.loader import load_model
from jaxllm.pooler_config import activate
from jaxllm.sampling_params import PoolingParams
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.programs import enable_compilation_cache

logger = logging.getLogger(__name__)


def pack_encoder_inputs(prompts: list[list[int]], t_pad: int, num_rows: int,
                        type_starts: list[int | None] | None = None) -> np.ndarray:
    """One flat int32 array: `[4, t_pad]` (input ids, positions, segment ids, token types;
    padding tokens sit in segment `num_rows`, alone), then `[2, num_rows]` (each request's
    first token and length; padding rows have length 0). A request's tokens from
    `type_starts[i]` on are of type 1 (None: all of type 0)."""
    lens = np.fromiter((len(p) for p in prompts), np.int32, len(prompts))
    total, n = int(lens.sum()), lens.size
    packed = np.zeros(4 * t_pad + 2 * num_rows, np.int32)
    tok = packed[:4 * t_pad].reshape(4, t_pad)
    req = packed[4 * t_pad:].reshape(2, num_rows)
    starts = np.cumsum(lens) - lens
    seg = np.repeat(np.arange(n, dtype=np.int32), lens)
    if total:
        tok[0, :total] = np.concatenate(prompts)
    tok[1, :total] = np.arange(total, dtype=np.int32) - starts[seg]
    tok[2, :total] = seg
    tok[2, total:] = num_rows
    if type_starts is not None and total:
        first = np.array([len(p) if t is None else t for p, t in zip(prompts, type_starts,
                                                                     strict=True)], np.int32)
        tok[3, :total] = tok[1, :total] >= first[seg]
    req[0, :n], req[1, :n] = starts, lens
    return packed


def pool_hidden(hidden: jax.Array, packed_req: jax.Array, segment_ids: jax.Array,
                pooling_type: str) -> jax.Array:
    """Float32 `[R, hidden]`: each request's tokens pooled (MEAN, CLS or LAST)."""
    starts, lens = packed_req[0], packed_req[1]
    num_rows = starts.shape[0]
    h32 = hidden.astype(jnp.float32)
    if pooling_type == "MEAN":
        sums = jax.ops.segment_sum(h32, segment_ids, num_segments=num_rows + 1)[:num_rows]
        return sums / jnp.maximum(lens, 1)[:, None].astype(jnp.float32)
    at = starts if pooling_type == "CLS" else starts + jnp.maximum(lens, 1) - 1
    return h32[jnp.clip(at, 0, hidden.shape[0] - 1)]


@dataclasses.dataclass
class EncoderStepHandle:
    """A dispatched encoder step whose pooled rows are (possibly) still on the device."""

    req_ids: list[str]
    pooled: jax.Array  # [max_num_seqs, hidden] float32, or a cross-encoder's logits
    params: list[PoolingParams]


class EncoderModelRunner:
    """Runs an encoder model's steps; the engine core drives it as it drives ModelRunner."""

    def __init__(self, config: EngineConfig):
        self.config = config
        mc, sc = config.model_config, config.scheduler_config
        enable_compilation_cache(config.compilation_cache_dir)
        pc = config.parallel_config
        self.mesh = make_mesh(pc.tensor_parallel_size, core_devices(
            pc.tensor_parallel_size, pc.data_parallel_size, pc.data_parallel_rank))
        t0 = time.perf_counter()
        attn = get_attention_backend(config.attention_backend, config.attention_interpret)
        model = load_model(mc, self.mesh, attn)
        graphdef, state = nnx.split(model)
        self.state = jax.tree.leaves(state)
        logger.info("loaded %s in %.1fs", mc.model, time.perf_counter() - t0)
        # Requests only: the block pool needs its reserved block and one more to exist;
        # no request ever takes one and nothing is allocated on the device.
        self.num_kv_blocks = 2
        self.kv_cache_bytes = 0
        self.buckets = Buckets.make(sc.max_num_batched_tokens, sc.max_num_seqs,
                                    mc.max_model_len, config.cache_config.block_size,
                                    config.token_buckets, config.request_buckets)
        self.num_rows = sc.max_num_seqs
        self.pooler_config = mc.pooler_config
        classifies = bool(getattr(model, "is_classifier", False))
        state_def = jax.tree.structure(state)
        pooling_type = "CLS" if classifies else self.pooler_config.pooling_type

        def encode(weights: list, packed: jax.Array) -> jax.Array:
            t_pad = (packed.shape[0] - 2 * self.num_rows) // 4
            tok = packed[:4 * t_pad].reshape(4, t_pad)
            req = packed[4 * t_pad:].reshape(2, self.num_rows)
            m = nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))
            with products_at(mc.dtype):
                hidden = m(tok[0], tok[1], tok[2], tok[3])
                pooled = pool_hidden(hidden, req, tok[2], pooling_type)
                return m.classify(pooled) if classifies else pooled

        self._encode = jax.jit(encode)
        self.wait_seconds = self.dispatch_seconds = 0.0
        self.step_log: list | None = None  # benchmarks' step records: none for an encoder

    def precompile(self) -> None:
        """Compiles the program of every token bucket now, so that serving never compiles."""
        t0 = time.perf_counter()
        for t in tqdm(self.buckets.token_buckets, desc="Precompiling buckets", unit="shape",
                      disable=os.environ.get("JAXLLM_NO_PROGRESS") == "1"):
            jax.block_until_ready(self._encode(self.state,
                                               pack_encoder_inputs([], t, self.num_rows)))
        logger.info("precompiled %d encoder shapes in %.1fs", len(self.buckets.token_buckets),
                    time.perf_counter() - t0)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput, sample: bool = True) -> EncoderStepHandle | None:
        """Launches the step's encode-and-pool program; returns without waiting."""
        if so.total_num_scheduled_tokens == 0:
            return None
        t0 = time.perf_counter()
        new = {r.req_id: r for r in so.scheduled_new_reqs}
        prompts, params = [], []
        for req_id, count in zip(so.req_ids, so.num_tokens.tolist(), strict=True):
            r = new.get(req_id)
            if r is None or count != len(r.prompt_token_ids):
                raise RuntimeError(f"encoder request {req_id!r} was not scheduled whole")
            prompts.append(r.prompt_token_ids)
            params.append(r.pooling_params)
        t_pad = self.buckets.pad_tokens(int(so.num_tokens.sum()))
        packed = pack_encoder_inputs(prompts, t_pad, self.num_rows,
                                     [p.token_type_start for p in params])
        pooled = self._encode(self.state, packed)
        self.dispatch_seconds += time.perf_counter() - t0
        return EncoderStepHandle(list(so.req_ids), pooled, params)

    def dispatch_sample(self, h: EncoderStepHandle | None, grammar_bitmask: Any) -> None:
        """Nothing to sample: an encoder only pools."""

    def collect(self, h: EncoderStepHandle | None) -> ModelRunnerOutput:
        """Waits for a dispatched step and returns its embeddings."""
        if h is None:
            return ModelRunnerOutput.empty()
        t0 = time.perf_counter()
        n = len(h.req_ids)
        vecs = np.asarray(h.pooled)[:n]
        self.wait_seconds += time.perf_counter() - t0
        out = {}
        pc = self.pooler_config
        for i, (req_id, params) in enumerate(zip(h.req_ids, h.params, strict=True)):
            if params.task == "classify":
                v = activate(pc.classify_activation, vecs[i])
            elif params.task == "score":
                v = activate(pc.score_activation, vecs[i])
            else:
                v = vecs[i] if params.dimensions is None else vecs[i, :params.dimensions]
                if params.normalize:
                    v = v / max(float(np.linalg.norm(v)), 1e-12)
            out[req_id] = v.tolist()
        return ModelRunnerOutput(req_ids=h.req_ids, sampled_token_ids=None, pooler_output=out,
                                 sampled_array=np.full(n, -1, np.int64))
