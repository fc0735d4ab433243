"""The paged KV cache layout that the TPU and GPU kernels share, and its update.

`[num_pages, 2 * num_kv_heads, page_size, head_dim]`: K of kv head h at 2h, V at
2h + 1, so one (page, head) is a contiguous `page_size x head_dim` tile (see the
layout notes in `tpu.py` and `gpu.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    return (num_pages, 2 * num_kv_heads, page_size, head_dim)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, page_offset: int = 0) -> jax.Array:
    """Stores `[T, Hkv, D]` K/V at `slot_mapping` (page * page_size + offset, pages
    counted from `page_offset`); in place when the cache is donated.

    One row scatter over the cache viewed as `[P * 2H * page_size, D]`, declared
    unique: only padding tokens share a slot (the reserved scratch page 0, never
    read as live KV). Declared unique, XLA emits a plain row scatter, several
    times faster than the general scatter (BENCHMARKS.md, kernels).
    """
    num_pages, two_h, page_size, head_dim = kv_cache.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0] * two_h, head_dim)
    head = jnp.arange(two_h, dtype=slot_mapping.dtype)[None, :]
    rows = (((slot_mapping // page_size + page_offset)[:, None] * two_h + head) * page_size
            + (slot_mapping % page_size)[:, None]).reshape(-1)
    flat = kv_cache.reshape(num_pages * two_h * page_size, head_dim)
    flat = flat.at[rows].set(kv.astype(kv_cache.dtype), mode="drop", unique_indices=True)
    return flat.reshape(kv_cache.shape)


def write_kv_padded(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
                    page_offset: int = 0) -> jax.Array:
    """`write_kv` into a cache whose minor dim may be wider than K/V's head_dim (the TPU
    cache's 128 lanes, the GPU cache's power of two): the extra columns are written as
    zeros."""
    pad = kv_cache.shape[-1] - k.shape[-1]
    if pad < 0:
        raise ValueError(f"K/V head_dim {k.shape[-1]} exceeds the cache's {kv_cache.shape[-1]}")
    if pad:
        widths = ((0, 0), (0, 0), (0, pad))
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)
    return write_kv(kv_cache, k, v, slot_mapping, page_offset)
