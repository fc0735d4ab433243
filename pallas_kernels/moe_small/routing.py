"""A small step's routing reduced to `gpu.py`'s slots in one Pallas GPU kernel (Triton
lowering), from the router logits: what jaxllm.layers.moe's `route` followed by
`routed_slots` gives, without the dozen-odd XLA kernels those take on the GPU (softmax,
the sorts behind `lax.top_k` and `jnp.unique`, scatters, pads).

One program holds the whole `[rows, E]` logits tile (the step's rows padded to the expert
kernels' row count, E to a power of two; both small at a decode step) in registers:

1. softmax over every expert in float32, as `jax.nn.softmax` (max, exp, sum, divide);
2. top-k as k rounds of a row max, ties going to the lower expert index (`lax.top_k`'s
   order), adding each round's value to the row's total for the optional renormalization;
3. the pairs this call keeps: chosen, on a real row (below `num_tokens`), and an expert of
   this call's `[first_expert, first_expert + local)`; an expert is present when any kept
   pair has it, and its slot is the exclusive running count of present experts before it
   (ascending slots, `jnp.unique`'s order);
4. masked stores scatter each present expert's id, its column of weights and of the
   row->slot mask to its slot; the slots from `count` on get the fill id `local`, zero
   weights and an empty mask (stores disjoint from the scatter's, so no two lanes race).

The lanes a store leaves out index past the slots: Pallas interpret mode writes a masked
lane's old value back, and out-of-range writes are dropped there, so no left-out lane can
land on a slot another lane writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import load as _load
from pallas_kernels.triton_util import store as _store


def num_slots(tokens: int, top_k: int, local: int) -> int:
    """The slots of a step of `tokens` rows: at most every pair, at most every local
    expert (`routed_slots`' `U`)."""
    return min(tokens * top_k, local)


def _route_kernel(logits_ref, first_ref, tokens_ref, experts_ref, count_ref, w_ref, mask_ref,
                  *, top_k: int, renormalize: bool, local: int):
    t, e = logits_ref.shape
    slots, rows = w_ref.shape
    width = pl.next_power_of_2(e)
    row = lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    # Rows past the step's read as zeros (finite, dropped below); columns past E as -inf,
    # which no softmax weight or top-k round takes.
    logits = _load(logits_ref, (row, col), mask=(row < t) & (col < e), other=0.0)
    logits = jnp.where(col < e, logits.astype(jnp.float32), -jnp.inf)
    p = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    probs = p / jnp.sum(p, axis=1, keepdims=True)

    cand = jnp.where(col < e, probs, -jnp.inf)
    chosen = jnp.zeros((rows, width), jnp.bool_)
    total = jnp.zeros((rows, 1), jnp.float32)
    for _ in range(top_k):
        best = jnp.max(cand, axis=1, keepdims=True)
        pick = jnp.min(jnp.where(cand == best, col, width), axis=1, keepdims=True)
        hit = col == pick
        chosen |= hit
        total += best
        cand = jnp.where(hit, -jnp.inf, cand)
    weight = probs / total if renormalize else probs

    first = first_ref[0]
    real = jnp.minimum(tokens_ref[0], t)
    expert = col - first
    kept = chosen & (row < real) & (expert >= 0) & (expert < local)
    present = jnp.max(kept.astype(jnp.int32), axis=0)  # [width]
    count = jnp.sum(present)
    # A present expert's slot; the rest index past the slots (see the module docstring).
    slot = jnp.where(present > 0, jnp.cumsum(present) - present, slots)

    ids = lax.broadcasted_iota(jnp.int32, (width,), 0) - first
    _store(experts_ref, (slot,), ids, mask=present > 0)
    slot_2d = jnp.broadcast_to(slot[None, :], (rows, width))
    present_2d = jnp.broadcast_to(present[None, :] > 0, (rows, width))
    _store(w_ref, (slot_2d, row), jnp.where(kept, weight, 0.0), mask=present_2d)
    _store(mask_ref, (slot_2d, row), kept.astype(jnp.int32), mask=present_2d)

    span = pl.next_power_of_2(slots)
    fill = lax.broadcasted_iota(jnp.int32, (span,), 0)
    _store(experts_ref, (fill,), jnp.full((span,), local, jnp.int32),
           mask=(fill >= count) & (fill < slots))
    fill_u = lax.broadcasted_iota(jnp.int32, (span, rows), 0)
    fill_t = lax.broadcasted_iota(jnp.int32, (span, rows), 1)
    fill_mask = (fill_u >= count) & (fill_u < slots)
    _store(w_ref, (fill_u, fill_t), jnp.zeros((span, rows), jnp.float32), mask=fill_mask)
    _store(mask_ref, (fill_u, fill_t), jnp.zeros((span, rows), jnp.int32), mask=fill_mask)
    count_ref[0] = count


def route_slots(logits: jax.Array, top_k: int, renormalize: bool, local: int, rows: int,
                first_expert: jax.Array | int = 0, num_tokens: jax.Array | int | None = None,
                *, num_warps: int | None = None, interpret: bool = False
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`routed_slots(*route(logits, top_k, renormalize), first_expert, local, num_tokens)`
    with its per-slot tables padded to `rows` rows, from router logits `[T, E]` float32:
    (experts `[U]` int32, ascending, `local` from `count` on; count `[1]` int32; weights
    `[U, rows]` float32; mask `[U, rows]` int32), `U = num_slots(T, top_k, local)`.
    Rows from `num_tokens` on (None: none), and from T on, route nowhere. `num_warps`
    None: 4, or 8 once the tile would hold more than 32 values a thread at 4 warps."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, {e}] (the experts)")
    if rows < t or rows & (rows - 1):
        raise ValueError(f"rows={rows} must be a power of two of at least the {t} tokens")
    slots = num_slots(t, top_k, local)
    tokens = t if num_tokens is None else num_tokens
    if num_warps is None:
        num_warps = 4 if rows * pl.next_power_of_2(e) <= 32 * 4 * 32 else 8
    return pl.pallas_call(
        functools.partial(_route_kernel, top_k=top_k, renormalize=renormalize, local=local),
        out_shape=(jax.ShapeDtypeStruct((slots,), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32),
                   jax.ShapeDtypeStruct((slots, rows), jnp.float32),
                   jax.ShapeDtypeStruct((slots, rows), jnp.int32)),
        compiler_params=_compiler_params(num_warps, 1), interpret=interpret,
        name="moe_small_route",
    )(logits.astype(jnp.float32), jnp.asarray(first_expert, jnp.int32).reshape(1),
      jnp.asarray(tokens, jnp.int32).reshape(1))
