"""The routed experts of a small (decode) step as two Pallas GPU kernels (Triton lowering),
reading each routed expert's weights in place, once.

Inputs are the step's routing reduced to slots: `experts [U]`, the distinct local experts
the real tokens routed to (the first `count` of them valid), and per slot the routing
weight of every row, `slot_weights [U, T]`, with `slot_mask [U, T]` saying which rows
routed there (padding rows and rows of other experts: none). `reference.py` is the jnp
oracle of the same contract. `moe_small` takes those slots as the layer's jnp routing
makes them; `moe_small_from_logits` takes the router logits instead and has routing.py's
kernel write the slots, already padded to the kernels' rows (no XLA ops between the
router's product and the experts but the split sum after them).

1. gate/up, grid (slot u, block of `block_n` columns of I). A program whose slot is past
   `count` returns at once. Otherwise it walks H in `block_k` chunks, each a
   `[rows, block_k]` tile of the tokens (every row: at most a few, read as a 16-row
   tensor-core tile whose extra rows are zeros) and `[block_n, block_k]` tiles of expert
   `experts[u]`'s gate and up weights, indexed straight in the stacked `[E, 2, I, H]`
   array (no gathered copy), and writes `h[u, :, block] = silu(gate) * up` in the model
   dtype.
2. down, grid (block of `block_h` columns of H, split s of `down_splits`): one loop
   over a contiguous share of the `count` slots (`I / block_k` steps each), each step
   the product of slot u's `[rows, block_k]` chunk of h and a `[block_h, block_k]` tile
   of its expert's down weight, scaled by the rows' routing weights and kept only where
   the row routed there (`where`: a padding row may hold anything, NaN included),
   summed in float32 into the split's partial output; the partials add up outside
   (no atomics). Small column blocks and the splits give the GPU many programs, and
   many loads in flight, though the step has few rows.

Every routed expert's weights are read once per step; the slots past `count` cost a
program launch and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.moe_small import routing
from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import dot_t as _dot_t
from pallas_kernels.triton_util import load as _load

MIN_TILE = 16  # the smallest tensor-core dot dimension Triton takes
MAX_ROWS = 64  # a program holds every row's tile: more would spill (prefill-sized steps)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables; every block a power of two of at least 16 dividing its dimension."""

    block_n: int  # gate/up output columns (of I) per program
    block_k: int  # gate/up reduction chunk (of H)
    block_h: int  # down output columns (of H) per program
    block_k_down: int  # down reduction chunk (of I)
    # Down programs per column block, each over its share of the slots, their partial
    # sums added after: more loads in flight than one program walking every slot.
    down_splits: int = 4
    num_warps: int = 4
    num_stages: int = 3


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing `n`, at most `cap`."""
    return min(n & -n, cap)


def supported(num_experts: int, hidden: int, inter: int, tokens: int = 1) -> bool:
    """Whether the kernels take these experts and a step of `tokens` rows: H and I
    multiples of 16 (Triton tiles are powers of two, and a block must divide its
    dimension), the stacked weights' element offsets within int32 (the lowering's
    pointer arithmetic), and at most MAX_ROWS rows."""
    return (hidden % MIN_TILE == 0 and inter % MIN_TILE == 0
            and num_experts * 2 * inter * hidden < 2**31 and tokens <= MAX_ROWS)


def default_block_sizes(hidden: int, inter: int) -> BlockSizes:
    """The narrowest output blocks (16 columns) so that even one token over 8 experts gives
    the GPU a few hundred programs, each small enough in shared memory (3 stages of
    16-row tiles) for several to share an SM: one wave, not a full one and a tail; the
    widest chunks up to 256 that divide H and I, for long loads. Two warps a program and
    eight down splits: the fastest of the block sweep at the Qwen3-30B-A3B shape on an
    H100 (BENCHMARKS.md), one row or sixteen."""
    if hidden % MIN_TILE or inter % MIN_TILE:
        raise ValueError(f"hidden={hidden} and intermediate={inter} must be multiples of "
                         f"{MIN_TILE} for the Triton kernels")
    return BlockSizes(block_n=MIN_TILE, block_k=_pow2_divisor(hidden, 256),
                      block_h=MIN_TILE, block_k_down=_pow2_divisor(inter, 256),
                      down_splits=8, num_warps=2)


def _gate_up_kernel(experts_ref, count_ref, x_ref, gate_up_ref, h_ref, *, block_n: int,
                    block_k: int, hidden: int):
    u, j = pl.program_id(0), pl.program_id(1)
    tokens, rows = x_ref.shape[0], h_ref.shape[1]

    @pl.when(u < count_ref[0])
    def _compute():
        e = experts_ref[u]
        cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

        def chunk(c, carry):
            gate, up = carry
            ks = pl.ds(pl.multiple_of(c * block_k, block_k), block_k)
            if tokens == rows:
                xs = x_ref[:, ks]
            else:  # the rows past the step's read as zeros (no padded copy of x)
                row = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
                col = c * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
                xs = _load(x_ref, (row, col), mask=row < tokens, other=0.0)
            gate += _dot_t(xs, gate_up_ref[e, 0, cols, ks])
            up += _dot_t(xs, gate_up_ref[e, 1, cols, ks])
            return gate, up

        zero = jnp.zeros((rows, block_n), jnp.float32)
        gate, up = lax.fori_loop(0, hidden // block_k, chunk, (zero, zero))
        # Rounded to the model dtype first, as the unfused products are.
        dtype = h_ref.dtype
        gate, up = gate.astype(dtype).astype(jnp.float32), up.astype(dtype).astype(jnp.float32)
        h_ref[u, :, cols] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(dtype)


def _down_kernel(experts_ref, count_ref, w_ref, mask_ref, h_ref, down_ref, o_ref, *,
                 block_h: int, block_k: int, inter: int, splits: int):
    j, s = pl.program_id(0), pl.program_id(1)
    rows = h_ref.shape[1]
    cols = pl.ds(pl.multiple_of(j * block_h, block_h), block_h)
    chunks = inter // block_k
    # This program's share of the routed slots: a contiguous run of cdiv(count, splits).
    count = count_ref[0]
    per = lax.div(count + splits - 1, splits)
    first = jnp.minimum(s * per, count)
    last = jnp.minimum(first + per, count)

    def step(i, acc):
        # lax's, not jnp's, integer ops: jnp's floor-mod fix-ups do not lower to Triton.
        u, c = lax.div(i, chunks), lax.rem(i, chunks)
        ks = pl.ds(pl.multiple_of(c * block_k, block_k), block_k)
        y = _dot_t(h_ref[u, :, ks], down_ref[experts_ref[u], cols, ks])
        keep = mask_ref[u, :] != 0
        return acc + jnp.where(keep[:, None], y * w_ref[u, :][:, None], 0.0)

    acc = lax.fori_loop(first * chunks, last * chunks, step,
                        jnp.zeros((rows, block_h), jnp.float32))
    o_ref[s, :, cols] = acc


def moe_small(x: jax.Array, gate_up: jax.Array, down: jax.Array, experts: jax.Array,
              count: jax.Array, slot_weights: jax.Array, slot_mask: jax.Array, *,
              block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """`sum_u slot_mask[u, t] * slot_weights[u, t] * expert_{experts[u]}(x[t])` over the
    slots `u < count`, `[T, H]` float32.

    `x [T, H]`; `gate_up [E, 2, I, H]`, `down [E, H, I]` (Hugging Face's `[out, in]`,
    the model dtype); `experts [U]` int32 expert ids (entries from `count` on are never
    read); `count` int32 scalar; `slot_weights [U, T]` float32; `slot_mask [U, T]` bool.
    """
    t = x.shape[0]
    slots = experts.shape[0]
    if slot_weights.shape != (slots, t) or slot_mask.shape != (slots, t):
        raise ValueError(f"slot_weights {slot_weights.shape} / slot_mask {slot_mask.shape} "
                         f"must be [{slots}, {t}]")
    # The slot tables padded to the kernels' rows; the extra rows are routed nowhere.
    pad = ((0, 0), (0, _rows(t) - t))
    w = jnp.pad(slot_weights.astype(jnp.float32), pad)
    mask = jnp.pad(slot_mask.astype(jnp.int32), pad)
    count = jnp.asarray(count, jnp.int32).reshape(1)
    return _experts(x, gate_up, down, experts.astype(jnp.int32), count, w, mask,
                    block_sizes, interpret)


def moe_small_from_logits(x: jax.Array, logits: jax.Array, gate_up: jax.Array,
                          down: jax.Array, top_k: int, renormalize: bool,
                          first_expert: jax.Array | int = 0,
                          num_tokens: jax.Array | int | None = None, *,
                          block_sizes: BlockSizes | None = None,
                          interpret: bool = False) -> jax.Array:
    """`moe_small` of the slots that router logits `[T, E]` give (softmax, `top_k`,
    renormalized over them when `renormalize`; rows from `num_tokens` on and experts
    outside `gate_up`'s `first_expert ...` route nowhere), the routing one kernel
    (routing.py) writing the slot tables already padded to the expert kernels' rows:
    three kernels in all, `[T, H]` float32."""
    t = x.shape[0]
    if logits.shape[0] != t:
        raise ValueError(f"logits {logits.shape} must have x's {t} rows")
    slots = routing.route_slots(logits, top_k, renormalize, gate_up.shape[0], _rows(t),
                                first_expert, num_tokens, interpret=interpret)
    return _experts(x, gate_up, down, *slots, block_sizes, interpret)


def _rows(tokens: int) -> int:
    """The kernels' row count: a power of two of at least one tensor-core tile."""
    return max(MIN_TILE, pl.next_power_of_2(tokens))


def _experts(x: jax.Array, gate_up: jax.Array, down: jax.Array, experts: jax.Array,
             count: jax.Array, w: jax.Array, mask: jax.Array,
             block_sizes: BlockSizes | None, interpret: bool) -> jax.Array:
    """The two expert kernels over slot tables already padded to `_rows(T)` rows: `w`
    float32 and `mask` int32, `[U, rows]`; `count` int32 `[1]`."""
    t, hidden = x.shape
    inter = gate_up.shape[2]
    slots = experts.shape[0]
    if gate_up.shape[1:] != (2, inter, hidden) or down.shape[1:] != (hidden, inter):
        raise ValueError(f"gate_up {gate_up.shape} / down {down.shape} do not match x {x.shape}")
    bs = block_sizes or default_block_sizes(hidden, inter)
    for name, block, dim in (("block_n", bs.block_n, inter), ("block_k", bs.block_k, hidden),
                             ("block_h", bs.block_h, hidden),
                             ("block_k_down", bs.block_k_down, inter)):
        if block < MIN_TILE or block & (block - 1) or dim % block:
            raise ValueError(f"{name}={block} must be a power of two of at least {MIN_TILE} "
                             f"dividing {dim}")
    rows = _rows(t)
    assert w.shape == mask.shape == (slots, rows), (w.shape, mask.shape, slots, rows)
    params = _compiler_params(bs.num_warps, bs.num_stages)

    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, block_n=bs.block_n, block_k=bs.block_k,
                          hidden=hidden),
        out_shape=jax.ShapeDtypeStruct((slots, rows, inter), gate_up.dtype),
        grid=(slots, inter // bs.block_n),
        compiler_params=params, interpret=interpret, name="moe_small_gate_up",
    )(experts, count, x.astype(gate_up.dtype), gate_up)
    out = pl.pallas_call(
        functools.partial(_down_kernel, block_h=bs.block_h, block_k=bs.block_k_down,
                          inter=inter, splits=bs.down_splits),
        out_shape=jax.ShapeDtypeStruct((bs.down_splits, rows, hidden), jnp.float32),
        grid=(hidden // bs.block_h, bs.down_splits),
        compiler_params=params, interpret=interpret, name="moe_small_down",
    )(experts, count, w, mask, h, down)
    return jnp.sum(out[:, :t], axis=0)
