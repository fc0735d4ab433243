"""The fused q/k norm, rotary and K/V write kernel (pallas_kernels/qkv_rope, Pallas
interpret mode) against the backend's jnp contract (`AttentionBackend.project_qkv`)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.attention_backend import AttentionBackend, AttentionMetadata
from jaxllm.layers.attention_pallas import PallasGPUBackend
from jaxllm.layers.rotary import RotaryEmbedding
from pallas_kernels.qkv_rope import gpu
from pallas_kernels.ragged_paged_attention import paged_layout

D = 64


def _rope(theta: float = 10000.0) -> RotaryEmbedding:
    config = types.SimpleNamespace(rope_theta=theta, max_position_embeddings=4096)
    return RotaryEmbedding.from_hf_config(config, D)


def _case(seed: int, tokens: int, kv_heads: int, group: int, dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    qkv = jax.random.normal(k1, (tokens, kv_heads, group + 2, D), jnp.float32) * 3.0
    norms = 1.0 + 0.2 * jax.random.normal(k2, (3, 2, D), jnp.float32)  # three layers'
    page_size, pages = 4, 12
    cache = jax.random.normal(k3, (pages * 3, 2 * kv_heads, page_size, D), jnp.float32)
    # Real tokens at distinct slots of pages 1..; the last token is padding (scratch slot 0).
    slots = np.random.default_rng(seed).permutation(np.arange(page_size, pages * page_size))
    slots = slots[:tokens].astype(np.int32)
    slots[-1] = 0
    positions = jnp.asarray(np.random.default_rng(seed + 1).integers(0, 3000, tokens), jnp.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), kv_lens=jnp.zeros(1, jnp.int32),
                           page_indices=jnp.zeros((1, 1), jnp.int32),
                           cu_q_lens=jnp.zeros(2, jnp.int32), num_seqs=jnp.ones(1, jnp.int32))
    return (qkv.astype(dtype), positions, cache.astype(dtype), md, norms.astype(dtype))


# Each group size, norm kind and dtype at least once; 7: a group that is no power of two.
@pytest.mark.parametrize("group, qk_norm, offset, dtype", [
    (1, True, False, jnp.float32), (4, False, False, jnp.bfloat16),
    (7, True, False, jnp.bfloat16), (7, True, True, jnp.float32), (4, True, True, jnp.bfloat16)])
def test_the_kernel_equals_the_jnp_contract(group, qk_norm, offset, dtype):
    qkv, positions, cache, md, norms = _case(group, tokens=5, kv_heads=2, group=group,
                                             dtype=dtype)
    kw = dict(rope=_rope(), qk_norms=norms if qk_norm else None, layer=1, eps=1e-6,
              offset=offset)
    page_offset = 12  # the layer's pages start at page 12 of the shared array
    backend = PallasGPUBackend(interpret=True)
    # The jnp contract, with the Pallas layout's own K/V write.
    want_q, want_cache = AttentionBackend.project_qkv(backend, qkv, positions, cache, md,
                                                      page_offset, **kw)
    got_q, got_cache = backend.project_qkv(qkv, positions, cache, md, page_offset, **kw)
    # Float32 agrees to rounding; bfloat16 to one rounding of the model dtype (the kernel
    # sums a head's squares in two halves, XLA in one pass).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=0.07, rtol=0.02)
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32),
                               **tol)
    np.testing.assert_allclose(np.asarray(got_cache, np.float32),
                               np.asarray(want_cache, np.float32), **tol)
    # Nothing but the step's slots changed: the written rows differ from the old cache.
    changed = np.any(np.asarray(got_cache) != np.asarray(cache), axis=-1)
    assert changed.sum() == 2 * 2 * 5  # K and V of two heads for five tokens
    if dtype == jnp.bfloat16:
        same = np.asarray(got_q) == np.asarray(want_q)
        assert same.mean() > 0.98  # nearly every element is bit-equal


def test_the_kernel_scales_cos_and_sin_by_the_ropes_attention_factor():
    """yarn's and longrope's factor on cos and sin (`RotaryEmbedding.scale`) reaches the
    rotated q and K as the jnp contract applies it."""
    qkv, positions, cache, md, norms = _case(11, tokens=3, kv_heads=2, group=2,
                                             dtype=jnp.float32)
    backend = PallasGPUBackend(interpret=True)
    outs = {}
    for scale in (1.0, 1.3):
        kw = dict(rope=dataclasses.replace(_rope(), scale=scale), qk_norms=norms, layer=0,
                  eps=1e-6, offset=False)
        want = AttentionBackend.project_qkv(backend, qkv, positions, cache, md, 0, **kw)
        got = backend.project_qkv(qkv, positions, cache, md, 0, **kw)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
        outs[scale] = np.asarray(got[0])
    np.testing.assert_allclose(outs[1.3], 1.3 * outs[1.0], atol=1e-5, rtol=1e-5)


def test_the_kernel_writes_k_and_v_where_the_layout_reads_them():
    qkv, positions, cache, md, _ = _case(3, tokens=4, kv_heads=2, group=2, dtype=jnp.float32)
    q, out = gpu.project_qkv(qkv, positions, jnp.asarray(_rope().inv_freq, jnp.float32), cache,
                             md.slot_mapping, 0, None, eps=1e-6, offset=False, interpret=True)
    page_size = cache.shape[2]
    for t, slot in enumerate(np.asarray(md.slot_mapping)):
        for h in range(2):
            v = out[slot // page_size, 2 * h + 1, slot % page_size]
            np.testing.assert_array_equal(np.asarray(v), np.asarray(qkv[t, h, 3]))
    assert q.shape == (4, 4, D)
    # The cache the layout's own write gives, for the V half, which no rotation touches.
    k = jnp.zeros((4, 2, D))
    ref = paged_layout.write_kv(cache, k, qkv[:, :, 3], md.slot_mapping, 0)
    np.testing.assert_array_equal(np.asarray(out[:, 1::2]), np.asarray(ref[:, 1::2]))


@pytest.mark.parametrize("parts, dtype, qk_norm", [
    (4, jnp.bfloat16, True), (3, jnp.float32, False), (2, jnp.bfloat16, False)])
def test_split_k_partials_give_the_projections_own_outputs(parts, dtype, qk_norm):
    """A split-K product's float32 partials, which the kernel adds in order and rounds to
    the model dtype as it loads them: the outputs are bit for bit the kernel's (and the
    jnp contract's) on that rounded sum, which is XLA's split GEMV's numerics."""
    qkv, positions, cache, md, norms = _case(parts, tokens=5, kv_heads=2, group=3,
                                             dtype=dtype)
    partials = jax.random.normal(jax.random.key(parts), (parts, *qkv.shape), jnp.float32)
    summed = partials[0]
    for p in partials[1:]:
        summed = summed + p
    summed = summed.astype(dtype)
    kw = dict(rope=_rope(), qk_norms=norms if qk_norm else None, layer=2, eps=1e-6,
              offset=False)
    backend = PallasGPUBackend(interpret=True)
    want = backend.project_qkv(summed, positions, cache, md, 12, **kw)
    got = backend.project_qkv(partials, positions, cache, md, 12, dtype=dtype, **kw)
    oracle = AttentionBackend.project_qkv(backend, partials, positions, cache, md, 12,
                                          dtype=dtype, **kw)
    oracle_summed = AttentionBackend.project_qkv(backend, summed, positions, cache, md, 12,
                                                 **kw)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    for g, w in zip(oracle, oracle_summed, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="model dtype"):
        gpu.project_qkv(partials, positions, jnp.asarray(_rope().inv_freq, jnp.float32),
                        cache, md.slot_mapping, 0, None, eps=1e-6, offset=False,
                        interpret=True)


def test_only_decode_shaped_steps_the_kernel_takes_are_split(monkeypatch):
    backend, rope = PallasGPUBackend(interpret=True), _rope()
    assert backend.qkv_parts(32, rope, True, None) == 4
    assert backend.qkv_parts(33, rope, True, None) == 0  # a prefill's partials: too large
    assert backend.qkv_parts(8, rope, False, None) == 0  # no K/V write: XLA's ops
    assert backend.qkv_parts(8, rope, True, jnp.ones(2)) == 0  # an fp8 cache: XLA's ops
    assert AttentionBackend().qkv_parts(8, rope, True, None) == 0
    monkeypatch.setenv("JAXLLM_QKV_SPLIT_K", "0")
    assert backend.qkv_parts(8, rope, True, None) == 0


@pytest.mark.parametrize("head_dim, rotary_dim, ok", [
    (128, 128, True), (16, 16, True), (64, 32, False), (96, 96, False), (8, 8, False)])
def test_supported_shapes(head_dim, rotary_dim, ok):
    assert gpu.supported(head_dim, rotary_dim) is ok
