"""A layer's attention front as one Pallas GPU kernel (Triton lowering): the input
RMSNorm, the fused QKV projection over all of K, the q/k norms, rotary and the K/V
cache write, for a step of a few token rows.

At a decode step XLA runs that front as four kernels (the norm, the QKV GEMV split
over K, the split-K sum, then `qkv_rope.gpu`), three of them moving a few KiB each
(BENCHMARKS.md, Qwen3-30B-A3B's per-layer timeline). Here one program per (kv head,
head of its group: G query heads, K, V) normalizes the step's rows itself (every
program reads the whole rows, a few KiB, so no program waits on another), streams that
head's `[D, H]` slice of the weight, and finishes the head in its epilogue as
`qkv_rope.gpu` does. Whole heads per program, because the q/k norms need a head's
every column.

The arithmetic and its roundings are the unfused path's: the norm as
`layers/norm.rms_norm`, the product accumulated in float32 and rounded to the model
dtype, then the head's norm and rotation as `qkv_rope.gpu`. Padding rows write their
slot (the scratch page), as that kernel does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.qkv_rope.gpu import cache_k_row, call_operands, head_rms_norm, rotate
from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import dot_t as _dot_t
from pallas_kernels.triton_util import load as _load
from pallas_kernels.triton_util import store as _store

MIN_ROWS = 16  # the smallest tensor-core dot dimension Triton takes
MAX_ROWS = 64  # every row's accumulator sits in registers


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # Reduction chunk of H, a power of two of at least 16 dividing it (None: the largest
    # up to 128, so that three stages of a head's two weight halves fit in shared memory).
    block_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    def chunk(self, hidden: int) -> int:
        return self.block_k or min(hidden & -hidden, 128)


def supported(head_dim: int, rotary_dim: int, hidden: int, tokens: int) -> bool:
    """Whole-head rotation of a power-of-two head whose halves are tensor-core tiles,
    H a multiple of 16, and at most MAX_ROWS rows."""
    return (rotary_dim == head_dim and head_dim >= 2 * MIN_ROWS
            and head_dim & (head_dim - 1) == 0 and hidden % MIN_ROWS == 0
            and tokens <= MAX_ROWS)


def _kernel(pos_ref, slot_ref, off_ref, layer_ref, freq_ref, x_ref, in_norm_ref, w_ref,
            qk_norm_ref, cache_ref, q_out_ref, cache_out_ref, *, rows: int, block_k: int,
            group: int, kv_heads: int, page_size: int, eps: float, offset: bool,
            qk_norm: bool):
    del cache_ref  # aliased to cache_out_ref
    h, j = pl.program_id(0), pl.program_id(1)
    tokens, hidden = x_ref.shape
    d = w_ref.shape[2]
    half = d // 2
    dtype = q_out_ref.dtype
    f32 = jnp.float32
    chunks = hidden // block_k

    r_iota = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
    k_iota = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    live = r_iota < tokens
    w_cols = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

    def x_chunk(c):
        return _load(x_ref, (r_iota, c * block_k + k_iota), mask=live, other=0.0).astype(f32)

    # The input norm's statistics over the whole row (rows past the step read as zeros).
    def squares(c, ss):
        xs = x_chunk(c)
        return ss + jnp.sum(xs * xs, axis=1, keepdims=True)

    ss = lax.fori_loop(0, chunks, squares, jnp.zeros((rows, 1), f32))
    inv_rms = lax.rsqrt(ss / hidden + eps)

    def step(c, acc):
        lo, hi = acc
        xs = x_chunk(c) * inv_rms
        nw = _load(in_norm_ref, (c * block_k + w_cols,)).astype(f32)
        if offset:
            xn = (xs * (1.0 + nw)).astype(dtype)
        else:
            xn = (nw * xs.astype(dtype).astype(f32)).astype(dtype)
        ks = pl.ds(pl.multiple_of(c * block_k, block_k), block_k)
        lo += _dot_t(xn, w_ref[h, j, pl.ds(0, half), ks])
        hi += _dot_t(xn, w_ref[h, j, pl.ds(half, half), ks])
        return lo, hi

    zero = jnp.zeros((rows, half), f32)
    lo, hi = lax.fori_loop(0, chunks, step, (zero, zero))
    # Rounded to the model dtype, as the unfused projection's output is.
    y = [lo.astype(dtype).astype(f32), hi.astype(dtype).astype(f32)]

    t_iota = lax.broadcasted_iota(jnp.int32, (rows, half), 0)
    c_iota = lax.broadcasted_iota(jnp.int32, (rows, half), 1)
    in_step = t_iota < tokens
    t_col = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    is_k = j == group

    def head_norm(x):
        """The q or k head's RMSNorm (weight row 2 * layer + 0 or 1)."""
        if not qk_norm:
            return x
        return head_rms_norm(x, qk_norm_ref, 2 * layer_ref[0] + is_k.astype(jnp.int32),
                             eps=eps, offset=offset, dtype=dtype)

    pos = _load(pos_ref, (t_col,), mask=t_col < tokens, other=0).astype(f32)
    angles = pos * freq_ref[...].reshape(1, half)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = head_norm(y)
    roped = rotate(x, cos, sin, dtype)

    # A query head: q out viewed as [T * KV * G, D].
    q_row = (t_iota * kv_heads + h) * group + j
    for i in (0, 1):
        _store(q_out_ref, (q_row, c_iota + i * half), roped[i], mask=in_step & (j < group))

    # K (normed, rotated) or V (as projected) to the token's cache slot.
    slot = _load(slot_ref, (t_col,), mask=t_col < tokens, other=0)
    k_row = cache_k_row(slot, off_ref[0], h, kv_heads=kv_heads, page_size=page_size)
    # Rows past the step point past the cache: masked either way, but interpret mode
    # writes a masked lane's old value back, which must not race a live row's store.
    k_row = jnp.where(t_col < tokens, k_row, cache_out_ref.shape[0] + page_size)
    cdt = cache_out_ref.dtype
    for i in (0, 1):
        _store(cache_out_ref, (k_row + 0 * c_iota, c_iota + i * half), roped[i].astype(cdt),
               mask=in_step & is_k)
        _store(cache_out_ref, (k_row + page_size + 0 * c_iota, c_iota + i * half),
               y[i].astype(cdt), mask=in_step & (j == group + 1))


def norm_project_qkv(x: jax.Array, in_norm: jax.Array, w_qkv: jax.Array,
                     positions: jax.Array, inv_freq: jax.Array, kv_cache: jax.Array,
                     slot_mapping: jax.Array, page_offset: jax.Array | int,
                     qk_norms: jax.Array | None, layer: jax.Array | int = 0, *, eps: float,
                     offset: bool, block_sizes: BlockSizes | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(q `[T, KV * G, D]` normed and rotated, the cache with this step's K/V written)
    for the residual stream `x [T, H]`.

    `in_norm [H]`: the layer's input RMSNorm weight; `w_qkv [KV, G + 2, D, H]`: the fused
    projection (per kv head: its G query heads, K, V), no bias; the rest as
    `qkv_rope.gpu.project_qkv`'s; `eps` and `offset` serve both norms, as the
    decoder's one `rms_norm_eps` and norm kind do.
    """
    t, hidden = x.shape
    kv_heads, g2, d, w_hidden = w_qkv.shape
    group = g2 - 2
    bs = block_sizes or BlockSizes()
    if w_hidden != hidden or in_norm.shape != (hidden,):
        raise ValueError(f"w_qkv {w_qkv.shape} / in_norm {in_norm.shape} do not take x {x.shape}")
    if kv_cache.shape[3] != d:
        raise ValueError(f"kv_cache {kv_cache.shape} does not hold w_qkv {w_qkv.shape}'s heads")
    block_k = bs.chunk(hidden)
    if not supported(d, d, hidden, t):
        raise ValueError(f"unsupported: head_dim {d}, hidden {hidden}, {t} rows")
    if block_k < MIN_ROWS or block_k & (block_k - 1) or hidden % block_k:
        raise ValueError(f"block_k={block_k} must be a power of two of at least {MIN_ROWS} "
                         f"dividing hidden={hidden}")
    out_shape, scalars, norms, cache_rows = call_operands(
        kv_cache, kv_heads, group, t, w_qkv.dtype, inv_freq, qk_norms, positions,
        slot_mapping, page_offset, layer, holder=f"w_qkv {w_qkv.shape}")
    kernel = functools.partial(_kernel, rows=max(MIN_ROWS, pl.next_power_of_2(t)),
                               block_k=block_k, group=group, kv_heads=kv_heads,
                               page_size=kv_cache.shape[2], eps=float(eps), offset=offset,
                               qk_norm=qk_norms is not None)
    q, cache = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(kv_heads, g2), input_output_aliases={9: 1},
        compiler_params=_compiler_params(bs.num_warps, bs.num_stages),
        interpret=interpret, name="norm_qkv_rope_write",
    )(*scalars, x, in_norm, w_qkv, norms, cache_rows)
    return q.reshape(t, kv_heads * group, d), cache.reshape(kv_cache.shape)
