"""The grouped matmul of the mixture-of-experts layer as a Pallas GPU kernel (Triton
lowering): `out[r] = lhs[r] @ rhs[g(r)].T` for rows sorted by group.

Work decomposition. Every group's run of rows is cut into tiles of `tm` rows (the
last one partial), by a few vectorised jnp ops (`tile_metadata`): per tile its
group, first row and end row. The tile count is bounded statically by
`cdiv(M, tm) + min(G, M)` (each non-empty group adds at most one partial tile);
slots past the real count are marked empty (group -1) and return at once.

A program handles one (output-column block, tile): it walks K in chunks of `bk`,
reading its tile's rows of `lhs` (rows of other groups masked to zero) and the
`[bn, bk]` block of its group's weight in place (a dynamic row offset into
`rhs` viewed as `[G * N, K]`, no copy), accumulating in float32 on the tensor
cores, and stores only its valid rows at their own positions, so the output
needs no un-padding. Rows past `sum(group_sizes)` are never written.

The column block is the fastest grid axis: the programs resident at once are a
few consecutive tiles across all column blocks, so a tile's rows and its
expert's weight are read from HBM about once and then hit L2.

Quantized operands (int8 / float8_e4m3fn) are read as they are and upcast in the
kernel to bfloat16 (float32 if the other operand is float32), which is exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Load/store spellings across jax versions and the Triton compiler params: one copy.
from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import load as _load
from pallas_kernels.triton_util import store as _store

FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables: `tm` rows per tile, `bn` output columns and `bk` contraction per
    program step (all powers of two, at least 16: the tensor-core tile)."""

    tm: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("tm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}: must be a power of two >= 16, got {v}")


def default_block_sizes(m: int, n: int, k: int, groups: int, itemsize: int = 2,
                        max_rows: int = 128) -> BlockSizes:
    """Static choice from the shapes, after the H100 tunings published for vLLM's fused-MoE
    Triton kernel at these expert shapes. `tm` about the mean group (M / G), 16..`max_rows`
    (rounded down to a power of two), so a tile wastes few rows. Full 128-row tiles are
    compute-bound: 128 x 256 output per program, 8 warps. Smaller ones mostly stream
    weights: 128-column blocks, 4 warps, and for 16..32 rows 128-deep chunks (fewer
    loop trips per byte). Three pipeline stages keep every bf16 choice within about
    150 KiB of the 227 KiB of shared memory; float32 tiles hold twice the bytes, so they
    get half the contraction chunk and two stages."""
    cap = 2 ** int(math.log2(max(16, max_rows)))
    tm = int(min(cap, max(16, 2 ** math.ceil(math.log2(max(1.0, m / groups))))))
    if tm >= 128:
        bn, bk, warps = 256, 64, 8
    elif tm == 64:
        bn, bk, warps = 128, 64, 4
    else:
        bn, bk, warps = 128, 128, 4
    if itemsize > 2:
        bk //= 2
    bn = int(min(bn, max(16, 2 ** math.ceil(math.log2(n)))))
    bk = int(min(bk, max(16, 2 ** math.ceil(math.log2(k)))))
    return BlockSizes(tm, bn, bk, num_warps=warps, num_stages=3 if itemsize <= 2 else 2)


def num_tiles(m: int, groups: int, tm: int) -> int:
    """The static bound on row tiles: `cdiv(M, tm)` plus one partial tile per
    non-empty group."""
    return pl.cdiv(m, tm) + min(groups, m)


def tile_metadata(group_sizes: jax.Array, m: int, tm: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(group, first row, end row) per tile slot, int32 `[num_tiles]`; group -1 marks an
    empty slot (no rows). Tiles follow the groups in order, `tm` rows each, a group's
    last tile ending at the group's end."""
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    per_group = (sizes + tm - 1) // tm
    cum = jnp.cumsum(per_group)
    tile = jnp.arange(num_tiles(m, groups, tm), dtype=jnp.int32)
    # compare_all: one fused comparison (the scan method is a loop of small kernels on GPU).
    g = jnp.searchsorted(cum, tile, side="right", method="compare_all").astype(jnp.int32)
    real = g < groups
    g = jnp.minimum(g, groups - 1)
    first = starts[g] + (tile - (cum[g] - per_group[g])) * tm
    end = jnp.minimum(first + tm, ends[g])
    return (jnp.where(real, g, -1), jnp.where(real, first, 0).astype(jnp.int32),
            jnp.where(real, end, 0).astype(jnp.int32))


def _operand_dtype(lhs_dtype: jnp.dtype, rhs_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the tiles are multiplied in: the operands' float type, float32 if
    either is, bfloat16 when neither is a float (int8 / fp8 upcast exactly)."""
    floats = [d for d in (jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)) if d in FLOATS]
    if not floats:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(functools.reduce(jnp.promote_types, floats))


def _zero(dtype: jnp.dtype) -> int | float:
    """A masked load's fill of `dtype`'s kind (Triton casts it to the element type)."""
    return 0.0 if jnp.issubdtype(dtype, jnp.floating) else 0


def _kernel(group_ref, first_ref, end_ref, lhs_ref, rhs_ref, out_ref, *, b: BlockSizes,
            n: int, k: int, operand: jnp.dtype):
    nb, tile = pl.program_id(0), pl.program_id(1)
    g = group_ref[tile]

    @pl.when(g >= 0)
    def _multiply():
        first, end = first_ref[tile], end_ref[tile]
        rows = first + lax.broadcasted_iota(jnp.int32, (b.tm,), 0)
        row_ok = rows < end
        cols = nb * b.bn + lax.broadcasted_iota(jnp.int32, (b.bn,), 0)
        k_iota = lax.broadcasted_iota(jnp.int32, (b.bk,), 0)
        k_tail = k % b.bk != 0  # static: only then are contraction chunks masked
        # Every dim indexed by an array (interpret mode has no discharge rule for
        # array + slice indexers).
        lhs_rows = jnp.broadcast_to(rows[:, None], (b.tm, b.bk))
        # Columns past N (a partial last block) read row N - 1 and are never stored.
        w_cols = jnp.minimum(cols, n - 1) if n % b.bn else cols
        rhs_rows = jnp.broadcast_to((g * n + w_cols)[:, None], (b.bn, b.bk))
        precision = lax.Precision.HIGHEST if operand == jnp.float32 else None

        def step(kc, acc):
            kk = kc * b.bk + k_iota
            x_mask = jnp.broadcast_to(row_ok[:, None], (b.tm, b.bk))
            if k_tail:
                x_mask &= (kk < k)[None, :]
            x = _load(lhs_ref, (lhs_rows, jnp.broadcast_to(kk[None, :], (b.tm, b.bk))),
                      mask=x_mask, other=_zero(lhs_ref.dtype))
            w_idx = (rhs_rows, jnp.broadcast_to(kk[None, :], (b.bn, b.bk)))
            if k_tail:
                w_mask = jnp.broadcast_to((kk < k)[None, :], (b.bn, b.bk))
                w = _load(rhs_ref, w_idx, mask=w_mask, other=_zero(rhs_ref.dtype))
            else:
                w = _load(rhs_ref, w_idx)
            return acc + lax.dot_general(x.astype(operand), w.astype(operand),
                                         (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, pl.cdiv(k, b.bk), step, jnp.zeros((b.tm, b.bn), jnp.float32))
        out_mask = jnp.broadcast_to(row_ok[:, None], (b.tm, b.bn))
        if n % b.bn:
            out_mask &= (cols < n)[None, :]
        _store(out_ref, (jnp.broadcast_to(rows[:, None], (b.tm, b.bn)),
                         jnp.broadcast_to(cols[None, :], (b.tm, b.bn))),
               acc.astype(out_ref.dtype), mask=out_mask)


# Triton's pointer offsets here are int32: an operand of more elements would wrap.
MAX_ELEMENTS = 2 ** 31 - 1


def supported(lhs: jax.Array, rhs: jax.Array) -> bool:
    """Whether every operand's and the output's element offsets fit the kernel's int32."""
    m, n = lhs.shape[0], rhs.shape[1]
    return max(lhs.size, rhs.size, m * n) <= MAX_ELEMENTS


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   out_dtype: jnp.dtype | None = None, block_sizes: BlockSizes | None = None,
                   max_rows: int = 128, interpret: bool = False) -> jax.Array:
    """`out [M, N]` with `out[r] = lhs[r] @ rhs[g(r)].T` for `lhs [M, K]` sorted by group,
    `rhs [G, N, K]`, `group_sizes [G]` summing to at most M; rows past the sum are left
    unwritten. `out_dtype` defaults to `lhs.dtype`; `max_rows` caps the default tile."""
    m, k = lhs.shape
    groups, n, k2 = rhs.shape
    if k2 != k:
        raise ValueError(f"rhs: contraction {k2} differs from lhs's {k}")
    if not supported(lhs, rhs):
        raise ValueError(f"lhs {lhs.shape} / rhs {rhs.shape}: an operand passes "
                         f"{MAX_ELEMENTS} elements (int32 offsets); check supported() first")
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
    operand = _operand_dtype(lhs.dtype, rhs.dtype)
    b = block_sizes or default_block_sizes(m, n, k, groups, operand.itemsize, max_rows)
    group, first, end = tile_metadata(group_sizes, m, b.tm)
    kernel = functools.partial(_kernel, b=b, n=n, k=k, operand=operand)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(n, b.bn), group.shape[0]),
        compiler_params=_compiler_params(b.num_warps, b.num_stages),
        interpret=interpret,
        name="grouped_matmul_gpu",
    )(group, first, end, lhs, rhs.reshape(groups * n, k))
