"""A layer's work between its fused QKV projection and attention, as one Pallas GPU kernel
(Triton lowering): the per-head q/k RMSNorms (Qwen3, Gemma 3), rotary embedding, and the
K/V cache write, for every token.

XLA runs that work as five small kernels a layer on the GPU (the q and k slices, the k
norm, the q norm with rope, the row scatter into the cache), each costing a launch and its
ramp for a few kilobytes at a decode step: longer, together, than the layer's attention
(BENCHMARKS.md, Qwen3-30B-A3B's profile). Here one
program per (token, kv head) loads the token's `[G + 2, D]` rows of that kv head (its G
query heads, K, V) once and does all of it:

1. q and k: RMSNorm over each head in float32 (Hugging Face's rounding: normalized, cast
   to the model dtype, times the weight; Gemma's `1 + w` in float32 then cast), then the
   rotation by the token's angles (`positions * inv_freq`, float32; "rotate half": the
   first and second halves of the head are loaded as two tiles, so no register shuffle);
2. q goes to the output `[T, G * KV, D]`; K and V to the cache rows of the token's slot,
   in the paged layout's `[pages, 2 * kv_heads, page_size, D]` (K of head h at 2h, V at
   2h + 1), the cache aliased in and out (in place when the step donates it).

The projection may come as a split-K product's float32 partials `[S, T, KV, G + 2, D]`,
which the program adds in order and rounds to the model dtype as it loads its rows: the
numerics of XLA's split-K GEMV, without its separate sum kernel (BENCHMARKS.md).

`jaxllm.layers.attention_backend.AttentionBackend.project_qkv` is the jnp oracle of the
same contract; tests/kernels/test_qkv_rope.py holds the kernel to it in interpret mode.
Padding tokens write their slot (the scratch page) as the XLA path does.
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


def supported(head_dim: int, rotary_dim: int) -> bool:
    """Whole-head rotation of an even, power-of-two head (Triton tiles are powers of two,
    and each half is one tile)."""
    return rotary_dim == head_dim and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _kernel(pos_ref, slot_ref, off_ref, layer_ref, freq_ref, qkv_ref, norm_ref, cache_ref,
            q_out_ref, cache_out_ref, *, group: int, kv_heads: int, page_size: int, eps: float,
            offset: bool, qk_norm: bool, parts: int, size: int, rope_scale: float):
    del cache_ref  # aliased to cache_out_ref
    t, h = pl.program_id(0), pl.program_id(1)
    d = qkv_ref.shape[1]
    half = d // 2
    gp = pl.next_power_of_2(group)
    dtype = q_out_ref.dtype

    def load(rows, cols, **kw):
        """qkv's tile in the model dtype: read, or the sum of its `parts` float32
        partials (`size` rows apart) rounded to it."""
        if not parts:
            return _load(qkv_ref, (rows, cols), **kw)
        total = _load(qkv_ref, (rows, cols), **kw)
        for p in range(1, parts):
            total = total + _load(qkv_ref, (rows + p * size, cols), **kw)
        return total.astype(dtype)

    # qkv viewed as [T * KV * (G + 2), D]: this program's rows start at `base`.
    base = (t * kv_heads + h) * (group + 2)
    g_iota = lax.broadcasted_iota(jnp.int32, (gp, half), 0)
    c_iota = lax.broadcasted_iota(jnp.int32, (gp, half), 1)
    in_group = g_iota < group
    lo = [load(base + g_iota, c_iota + k * half, mask=in_group, other=0.0)
          .astype(jnp.float32) for k in (0, 1)]
    kc = lax.broadcasted_iota(jnp.int32, (1, half), 1)
    kr = jnp.zeros((1, half), jnp.int32)
    k_rows = [load(base + group + kr, kc + k * half).astype(jnp.float32) for k in (0, 1)]
    v_rows = [load(base + group + 1 + kr, kc + k * half) for k in (0, 1)]

    def norm(x, which):
        """RMSNorm of each row of the two halves `x`, with weight row `which` (0 q, 1 k),
        rounded as layers/norm.py's `rms_norm`."""
        if not qk_norm:  # x holds model-dtype values already
            return x
        ss = jnp.sum(x[0] * x[0], axis=1, keepdims=True) + jnp.sum(x[1] * x[1], axis=1,
                                                                   keepdims=True)
        r = lax.rsqrt(ss / d + eps)
        row = jnp.full((1, half), 2 * layer_ref[0] + which, jnp.int32)
        out = []
        for k in (0, 1):
            w = _load(norm_ref, (row, kc + k * half)).astype(jnp.float32)
            if offset:
                out.append((x[k] * r * (1.0 + w)).astype(dtype).astype(jnp.float32))
            else:
                n = (x[k] * r).astype(dtype).astype(jnp.float32)
                out.append((w * n).astype(dtype).astype(jnp.float32))
        return out

    angles = pos_ref[t].astype(jnp.float32) * freq_ref[...].reshape(1, half)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if rope_scale != 1.0:
        cos, sin = cos * rope_scale, sin * rope_scale

    def rope(x):
        return [(x[0] * cos - x[1] * sin).astype(dtype), (x[1] * cos + x[0] * sin).astype(dtype)]

    q = rope(norm(lo, 0))
    k = rope(norm(k_rows, 1))

    # q out viewed as [T * KV * G, D].
    q_row = (t * kv_heads + h) * group + g_iota
    for i in (0, 1):
        _store(q_out_ref, (q_row, c_iota + i * half), q[i], mask=in_group)

    slot = slot_ref[t]
    page = slot // page_size + off_ref[0]
    k_row = (page * (2 * kv_heads) + 2 * h) * page_size + slot % page_size + kr
    cdt = cache_out_ref.dtype
    for i in (0, 1):
        _store(cache_out_ref, (k_row, kc + i * half), k[i].astype(cdt))
        _store(cache_out_ref, (k_row + page_size, kc + i * half), v_rows[i].astype(cdt))


def project_qkv(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                kv_cache: jax.Array, slot_mapping: jax.Array, page_offset: jax.Array | int,
                qk_norms: jax.Array | None, layer: jax.Array | int = 0, *, eps: float,
                offset: bool, dtype: jnp.dtype | None = None, rope_scale: float = 1.0,
                num_warps: int = 1, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(q `[T, KV * G, D]` normed and rotated, the cache with this step's K/V written).

    `qkv [T, KV, G + 2, D]` (per kv head: its G query heads, K, V); `positions [T]`;
    `inv_freq [D / 2]` float32; `kv_cache [P, 2 * KV, page_size, D]`; `slot_mapping [T]`
    (page * page_size + offset, pages counted from `page_offset`); `qk_norms [L, 2, D]`
    (every layer's q then k weights, row `layer` used; read in place, where a slice would
    be a copy) or None for no q/k norm; `eps`, `offset` as `rms_norm`'s; `rope_scale`
    multiplies cos and sin (`RotaryEmbedding.scale`). `qkv` may be
    float32 partials `[S, T, KV, G + 2, D]` instead, summed here and rounded to `dtype`.
    """
    parts = qkv.shape[0] if qkv.ndim == 5 else 0
    if parts and (qkv.dtype != jnp.float32 or dtype is None):
        raise ValueError(f"partials {qkv.shape} {qkv.dtype} need float32 and a model dtype")
    dtype = dtype if parts else qkv.dtype
    t, kv_heads, g2, d = qkv.shape[-4:]
    group = g2 - 2
    num_pages, two_h, page_size, _ = kv_cache.shape
    if two_h != 2 * kv_heads or kv_cache.shape[3] != d:
        raise ValueError(f"kv_cache {kv_cache.shape} does not hold qkv {qkv.shape}'s heads")
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"inv_freq {inv_freq.shape} must be [{d // 2}]")
    norms = (qk_norms if qk_norms is not None else jnp.zeros((1, 2, d), dtype))
    kernel = functools.partial(_kernel, group=group, kv_heads=kv_heads, page_size=page_size,
                               eps=float(eps), offset=offset, qk_norm=qk_norms is not None,
                               parts=parts, size=t * kv_heads * g2,
                               rope_scale=float(rope_scale))
    q, cache = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((t * kv_heads * group, d), dtype),
                   jax.ShapeDtypeStruct((num_pages * two_h * page_size, d), kv_cache.dtype)),
        grid=(t, kv_heads),
        input_output_aliases={7: 1},
        compiler_params=_compiler_params(num_warps, 1),
        interpret=interpret, name="qkv_rope_write",
    )(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32),
      jnp.asarray(page_offset, jnp.int32).reshape(1), jnp.asarray(layer, jnp.int32).reshape(1),
      inv_freq.astype(jnp.float32), qkv.reshape(-1, d),
      norms.reshape(-1, d), kv_cache.reshape(-1, d))
    return q.reshape(t, kv_heads * group, d), cache.reshape(kv_cache.shape)
