"""Packing one step's scheduled tokens into the forward's inputs, vectorized over rows.

The forward takes its integer inputs as one flat int32 host array, so that a
step moves one buffer to the device and not nine (each transfer costs the
host time, most of all beside a GPU). `pack_step_inputs` lays that array out,
`unpack_step_inputs` reads it back inside the jitted forward, and
`prepare_step_inputs` fills it from the persistent `InputBatch` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.input_batch import InputBatch


def pack_step_inputs(t_pad: int, num_reqs: int, width: int) -> tuple[np.ndarray, ...]:
    """The step's integer inputs in one zeroed host array (src -1), with writable views.

    Layout, flat int32: `req` [num_reqs, width + 4] (page table, then kv_lens,
    cu_q_lens[1:], num_seqs and the output index each request samples, in
    every row), then `tok` [4, t_pad] (input ids, positions, slot mapping,
    src: the row of the in-flight step's output that holds a token the host
    has not seen, -1 none). Returns (packed, input_ids, positions, slots, src,
    page_indices, kv_lens, cu_end, num_seqs, out_index).
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


def src_view(packed: np.ndarray, num_reqs: int, width: int) -> np.ndarray:
    """The writable `src` row of `pack_step_inputs`' array (speculative drafts made on
    the device name their row of the proposer's output there)."""
    split = num_reqs * (width + 4)
    return packed[split:].reshape(4, -1)[3]


@dataclass
class StepInputs:
    """One step's packed forward inputs and the per-request numbers the runner reuses."""

    packed: np.ndarray  # the forward's integer inputs (`pack_step_inputs`)
    num_tokens: int  # scheduled tokens
    padded_tokens: int  # the token bucket
    computed: np.ndarray  # [n] tokens each request had computed before the step
    first: np.ndarray  # [n] offset of each request's first token in the step
    kv_lens: np.ndarray  # [n] each request's computed tokens after the step
    reads_prev: bool  # some token is read from the in-flight step's output


def prepare_step_inputs(ib: InputBatch, rows: np.ndarray, num_scheduled: np.ndarray,
                        buckets: Buckets, block_size: int,
                        arange: np.ndarray) -> StepInputs:
    """The forward's inputs for requests in `rows`, each computing `num_scheduled` tokens.

    Padding tokens write slot 0 (the null block); padding requests have no
    tokens and no KV. A scheduled token the host does not know yet (sampled
    by the step still in flight) gets its row in that step's output as `src`.
    `arange` is `np.arange(max_num_seqs + 1)`, made once by the caller.
    """
    n = rows.size
    t_real = int(num_scheduled.sum())
    t_pad = buckets.pad_tokens(t_real)
    (packed, input_ids, positions, slots, src, page_indices, kv_lens, cu_end, num_seqs,
     out_idx) = pack_step_inputs(t_pad, buckets.max_num_seqs, buckets.max_blocks_per_req)
    computed = ib.num_computed_tokens[rows]
    pos = positions[:t_real]
    if t_real == n:  # one token per request (decode): token i belongs to request i
        cu, first = arange[1:n + 1], arange[:n]
        pos[:] = computed
        tok_rows = rows
    else:
        cu = np.cumsum(num_scheduled)
        req_of_tok = np.repeat(arange[:n], num_scheduled)
        first = cu - num_scheduled
        pos[:] = computed[req_of_tok] + (np.arange(t_real) - first[req_of_tok])
        tok_rows = rows[req_of_tok]
    cu_end[:n] = cu
    cu_end[n:] = t_real
    num_seqs[:] = n
    input_ids[:t_real] = ib.token_ids[tok_rows, np.minimum(pos, ib.max_model_len - 1)]
    unknown = pos >= ib.num_tokens[tok_rows]
    reads_prev = bool(unknown.any())
    if reads_prev:
        src[:t_real][unknown] = ib.inflight_index[tok_rows[unknown]]
        if (src[:t_real][unknown] < 0).any():
            raise RuntimeError("a scheduled token is neither known nor in flight")
    slots[:t_real] = ib.block_table[tok_rows, pos // block_size] * block_size + pos % block_size
    kv_lens[:n] = end = computed + num_scheduled
    page_indices[:n] = ib.block_table[rows]
    out_idx[:n] = np.maximum(end - ib.num_prompt_tokens[rows], 0)
    return StepInputs(packed, t_real, t_pad, computed, first, end, reads_prev)


def prompt_logprobs_targets(ib: InputBatch, req_ids: list[str], rows: np.ndarray,
                            num_scheduled: np.ndarray, inputs: StepInputs,
                            num_positions: int) -> tuple[np.ndarray, dict[str, slice]] | None:
    """The prompt-logprobs program's targets over the step's `num_positions` tokens, and
    each asking request's span in them; None when no position is due this step."""
    spans = {}
    targets = np.zeros(num_positions, np.int32)
    computed, first = inputs.computed, inputs.first
    for i in np.flatnonzero(ib.wants_prompt_logprobs[rows]):
        # Positions [start, stop) of this step's tokens for the request (a
        # resumed request skips those scored before its preemption).
        row = rows[i]
        start = max(computed[i], ib.prompt_logprobs_from[row])
        stop = min(computed[i] + num_scheduled[i], ib.num_prompt_tokens[row] - 1)
        if start >= stop:
            continue
        at = first[i] + start - computed[i]  # in the step's tokens
        targets[at:at + stop - start] = ib.token_ids[row, start + 1:stop + 1]
        spans[req_ids[i]] = slice(at, at + stop - start)
    return (targets, spans) if spans else None
