"""The attention-front kernel (pallas_kernels/qkv_rope/fused_gpu.py, Pallas interpret
mode) against the unfused path it replaces: `rms_norm`, the fused QKV einsum, then the
`qkv_rope` kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.norm import rms_norm
from pallas_kernels.qkv_rope import fused_gpu, gpu

D, HIDDEN, PAGE, PAGES = 64, 256, 4, 12


def _case(seed: int, tokens: int, kv_heads: int, group: int, dtype):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (tokens, HIDDEN), jnp.float32) * 2.0
    in_norm = 1.0 + 0.2 * jax.random.normal(ks[1], (HIDDEN,), jnp.float32)
    w = jax.random.normal(ks[2], (kv_heads, group + 2, D, HIDDEN), jnp.float32) * HIDDEN ** -0.5
    qk_norms = 1.0 + 0.2 * jax.random.normal(ks[3], (3, 2, D), jnp.float32)  # three layers'
    cache = jax.random.normal(ks[4], (PAGES * 3, 2 * kv_heads, PAGE, D), jnp.float32)
    # Real tokens at distinct slots of pages 1..; the last token is padding (scratch slot 0).
    slots = np.random.default_rng(seed).permutation(np.arange(PAGE, PAGES * PAGE))
    slots = slots[:tokens].astype(np.int32)
    slots[-1] = 0
    positions = np.random.default_rng(seed + 1).integers(0, 3000, tokens).astype(np.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return dict(x=cast(x), in_norm=cast(in_norm), w=cast(w), qk_norms=cast(qk_norms),
                cache=cast(cache), slots=jnp.asarray(slots), positions=jnp.asarray(positions),
                inv_freq=jnp.asarray(inv_freq))


def _unfused(c, *, qk_norm, offset, eps=1e-6, layer=1, page_offset=12):
    xn = rms_norm(c["x"], c["in_norm"], eps, offset)
    qkv = jnp.einsum("th,kgdh->tkgd", xn, c["w"], preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST).astype(c["x"].dtype)
    return gpu.project_qkv(qkv, c["positions"], c["inv_freq"], c["cache"], c["slots"],
                           page_offset, c["qk_norms"] if qk_norm else None, layer, eps=eps,
                           offset=offset, interpret=True)


def _fused(c, *, qk_norm, offset, eps=1e-6, layer=1, page_offset=12, block_k=64):
    return fused_gpu.norm_project_qkv(
        c["x"], c["in_norm"], c["w"], c["positions"], c["inv_freq"], c["cache"], c["slots"],
        page_offset, c["qk_norms"] if qk_norm else None, layer, eps=eps, offset=offset,
        block_sizes=fused_gpu.BlockSizes(block_k=block_k), interpret=True)


# Each norm kind and dtype; one row (decode), a few, and more than one 16-row tile;
# 7: a group that is no power of two.
@pytest.mark.parametrize("tokens, group, qk_norm, offset, dtype", [
    (1, 4, True, False, jnp.float32), (5, 7, True, True, jnp.float32),
    (3, 1, False, False, jnp.bfloat16), (20, 4, True, False, jnp.bfloat16),
    (2, 2, True, True, jnp.bfloat16)])
def test_the_kernel_equals_the_unfused_path(tokens, group, qk_norm, offset, dtype):
    c = _case(tokens + group, tokens, kv_heads=2, group=group, dtype=dtype)
    want_q, want_cache = _unfused(c, qk_norm=qk_norm, offset=offset)
    got_q, got_cache = _fused(c, qk_norm=qk_norm, offset=offset)
    assert got_q.shape == want_q.shape and got_cache.shape == want_cache.shape
    g, w = np.asarray(got_q, np.float32), np.asarray(want_q, np.float32)
    gc, wc = np.asarray(got_cache, np.float32), np.asarray(want_cache, np.float32)
    if dtype == jnp.float32:  # summation order only
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(gc, wc, rtol=2e-5, atol=2e-5)
    else:  # a product's rounding to bf16 may land one ulp apart, then carry through the norm
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(gc, wc, rtol=2e-2, atol=2e-2)
        assert np.mean(g == w) > 0.9 and np.mean(gc == wc) > 0.99
    # Only the step's slots changed in the cache (the rest aliased through untouched).
    changed = np.any(gc != np.asarray(c["cache"], np.float32), axis=-1)
    pages_rows = {(int(s) // PAGE + 12, int(s) % PAGE) for s in np.asarray(c["slots"])}
    for p, h, r in zip(*np.nonzero(changed), strict=True):
        assert (p, r) in pages_rows, (p, h, r)


def test_unsupported_shapes_are_refused_with_the_reason():
    c = _case(0, 1, kv_heads=2, group=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_k=96"):
        _fused(c, qk_norm=True, offset=False, block_k=96)
    assert not fused_gpu.supported(D, D, HIDDEN, fused_gpu.MAX_ROWS + 1)
