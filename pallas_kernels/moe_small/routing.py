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
from jax.experimental.pallas import triton as plt

from pallas_kernels.triton_util import atomic_add as _atomic_add
from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import dot_t as _dot_t
from pallas_kernels.triton_util import load as _load
from pallas_kernels.triton_util import store as _store


def num_slots(tokens: int, top_k: int, local: int) -> int:
    """The slots of a step of `tokens` rows: at most every pair, at most every local
    expert (`routed_slots`' `U`)."""
    return min(tokens * top_k, local)


def _route_kernel(logits_ref, first_ref, tokens_ref, experts_ref, count_ref, w_ref, mask_ref,
                  *, top_k: int, renormalize: bool, local: int):
    t, e = logits_ref.shape
    rows = w_ref.shape[1]
    width = pl.next_power_of_2(e)
    row = lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    # Rows past the step's read as zeros (finite, dropped in `_route`).
    logits = _load(logits_ref, (row, col), mask=(row < t) & (col < e), other=0.0)
    _route(logits.astype(jnp.float32), e, t, first_ref[0], tokens_ref[0], experts_ref,
           count_ref, w_ref, mask_ref, top_k=top_k, renormalize=renormalize, local=local)


def _route(logits, e: int, t: int, first, tokens, experts_ref, count_ref, w_ref, mask_ref, *,
           top_k: int, renormalize: bool, local: int):
    """Steps 1-4 of the module docstring for one program's `[rows, width]` float32 tile
    of logits (columns from `e` on, and rows from `t` on, are ignored)."""
    slots, rows = w_ref.shape
    width = logits.shape[1]
    row = lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    # Columns past E as -inf, which no softmax weight or top-k round takes.
    logits = jnp.where(col < e, logits, -jnp.inf)
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

    real = jnp.minimum(tokens, t)
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


# Hidden columns per program of `norm_route_slots`: each program's share of the router
# (E x 64) is small, and H / 64 programs (32 at H = 2048) keep the last program's sum short.
NORM_ROUTE_BLOCK = 64
# The most rows `norm_route_slots` takes (the small steps'): its last program sums every
# program's partial logits for each real row in turn.
NORM_ROUTE_MAX_TOKENS = 16


def _norm_route_kernel(h_ref, norm_ref, router_ref, first_ref, tokens_ref, ticket_in,
                       experts_ref, count_ref, w_ref, mask_ref, scale_ref, hw_ref, part_ref,
                       sums_ref, ticket_ref, *, top_k: int, renormalize: bool, local: int,
                       eps: float, block: int, interpret: bool):
    del ticket_in  # the same buffer as ticket_ref (aliased)
    j = pl.program_id(0)
    t, hidden = h_ref.shape
    e = router_ref.shape[0]
    rows, width = w_ref.shape[1], part_ref.shape[1]
    programs = hidden // block
    real = jnp.minimum(tokens_ref[0], t)  # the step's tokens; the rows after are padding

    # This program's columns: its rows of h (rows past the step's read as zeros), `h * w`
    # for the gate/up kernel, and into this program's own slots the real rows' sums of
    # squares and partial router logits `(h * w) @ router.T` (in the router's dtype, as
    # the unfused product takes the normed input).
    row = lax.broadcasted_iota(jnp.int32, (rows, block), 0)
    col = j * block + lax.broadcasted_iota(jnp.int32, (rows, block), 1)
    x = _load(h_ref, (row, col), mask=row < t, other=0.0).astype(jnp.float32)
    xw = x * norm_ref[pl.ds(pl.multiple_of(j * block, block), block)].astype(jnp.float32)
    _store(hw_ref, (row, col), xw.astype(hw_ref.dtype), mask=row < t)
    er = lax.broadcasted_iota(jnp.int32, (width, block), 0)
    ec = j * block + lax.broadcasted_iota(jnp.int32, (width, block), 1)
    r = _load(router_ref, (er, ec), mask=er < e, other=0.0)
    lrow = lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    lcol = lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    _store(part_ref, (j * t + lrow, lcol), _dot_t(xw.astype(r.dtype), r), mask=lrow < real)
    srow = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    _store(sums_ref, (j * t + srow,), jnp.sum(x * x, axis=1), mask=srow < real)
    # Every thread's stores come before this program's ticket (one thread takes it, an
    # acquire-release atomic, after the barrier), so the program holding the last ticket
    # sees every program's partials (strong loads).
    if not interpret:
        plt.debug_barrier()
    index = (jnp.int32(0),)  # an array, which interpret mode's loads take
    mine = _atomic_add(ticket_ref, index, jnp.float32(1.0), interpret=interpret)

    @pl.when(mine == programs - 1)
    def _last():
        prog = lax.broadcasted_iota(jnp.int32, (programs, width), 0)
        pcol = lax.broadcasted_iota(jnp.int32, (programs, width), 1)
        sprog = lax.broadcasted_iota(jnp.int32, (programs,), 0)
        logits = jnp.zeros((rows, width), jnp.float32)
        ss = jnp.zeros((rows,), jnp.float32)
        for k in range(t):  # real row k's partials, over every program
            part = _load(part_ref, (prog * t + k, pcol), mask=k < real, other=0.0,
                         volatile=True)
            logits = jnp.where(lrow == k, jnp.sum(part, axis=0)[None, :], logits)
            sums = _load(sums_ref, (sprog * t + k,), mask=k < real, other=0.0, volatile=True)
            ss = jnp.where(srow == k, jnp.sum(sums), ss)
        # rms_norm's factor: rsqrt(mean(h^2) + eps).
        scale = lax.rsqrt(ss / hidden + eps)
        _store(scale_ref, (srow,), scale)
        _route(logits * scale[:, None], e, t, first_ref[0], real, experts_ref,
               count_ref, w_ref, mask_ref, top_k=top_k, renormalize=renormalize, local=local)


def norm_route_slots(h: jax.Array, norm: jax.Array, router: jax.Array, eps: float,
                     top_k: int, renormalize: bool, local: int, rows: int,
                     first_expert: jax.Array | int = 0,
                     num_tokens: jax.Array | int | None = None, *, interpret: bool = False
                     ) -> tuple[jax.Array, ...]:
    """`route_slots` of the router logits of `rms_norm(h, norm, eps)`, from the residual
    stream `h [T, H]` itself (T <= NORM_ROUTE_MAX_TOKENS), in one kernel where XLA runs
    four (the norm, the router's product, its split-K sum, the routing): the slot tables,
    then the norm's factor `rsqrt(mean(h^2) + eps)` per row, `[rows]` float32, and
    `h * norm` `[T, H]` in h's dtype, for the gate/up kernel
    (`rms_norm(h) @ W.T = factor * ((h * norm) @ W.T)`).

    The norm is deferred past the products: per row it is one factor `s`, so
    `(w * h * s) @ R.T = s * ((w * h) @ R.T)`. Each program takes `NORM_ROUTE_BLOCK`
    columns of H and writes the real rows' partial logits and sums of squares to its own
    slots, then takes a ticket (an atomic add); the program holding the last ticket sums
    the slots and routes. In float32 this equals the unfused path to rounding; in bfloat16
    the unfused path rounds `w * (h * s)` to bf16 where this one rounds `h * w` (the
    gate/up input) or nothing (the router's).
    """
    t, hidden = h.shape
    e = router.shape[0]
    if router.shape[1] != hidden or norm.shape != (hidden,):
        raise ValueError(f"router {router.shape} / norm {norm.shape} do not match h {h.shape}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, {e}] (the experts)")
    if rows < t or rows & (rows - 1):
        raise ValueError(f"rows={rows} must be a power of two of at least the {t} tokens")
    if t > NORM_ROUTE_MAX_TOKENS:
        raise ValueError(f"{t} rows: at most {NORM_ROUTE_MAX_TOKENS}")
    block = min(NORM_ROUTE_BLOCK, hidden & -hidden)
    if block < 16:
        raise ValueError(f"hidden={hidden} must be a multiple of 16")
    programs = hidden // block
    slots = num_slots(t, top_k, local)
    width = max(16, pl.next_power_of_2(e))  # a tensor-core tile at least
    tokens = t if num_tokens is None else num_tokens
    *slot_tables, scale, hw, _, _, _ = pl.pallas_call(
        functools.partial(_norm_route_kernel, top_k=top_k, renormalize=renormalize,
                          local=local, eps=float(eps), block=block, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((slots,), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32),
                   jax.ShapeDtypeStruct((slots, rows), jnp.float32),
                   jax.ShapeDtypeStruct((slots, rows), jnp.int32),
                   jax.ShapeDtypeStruct((rows,), jnp.float32),
                   jax.ShapeDtypeStruct((t, hidden), h.dtype),
                   # each program's partial logits and sums of squares, by (program, row)
                   jax.ShapeDtypeStruct((programs * t, width), jnp.float32),
                   jax.ShapeDtypeStruct((programs * t,), jnp.float32),
                   jax.ShapeDtypeStruct((1,), jnp.float32)),  # the tickets taken
        grid=(programs,),
        input_output_aliases={5: 8},
        compiler_params=_compiler_params(4 if rows * width <= 32 * 4 * 32 else 8, 1),
        interpret=interpret, name="moe_small_norm_route",
    )(h, norm, router, jnp.asarray(first_expert, jnp.int32).reshape(1),
      jnp.asarray(tokens, jnp.int32).reshape(1), jnp.zeros((1,), jnp.float32))
    return (*slot_tables, scale, hw)
