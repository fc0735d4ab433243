"""Attention sinks (GPT-OSS): each query head's learned logit joins its softmax as a key
without a value. The XLA body is held to a dense numpy softmax with the extra column;
every Pallas backend's `attend` (interpret mode), alone and split over two devices
under `shard_map`, is held to the XLA body."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxllm.layers.attention import AttentionBackend, AttentionMetadata
from jaxllm.layers.attention_pallas import (
    PallasGPUBackend,
    PallasGPUMosaicBackend,
    PallasTPUBackend,
)
from jaxllm.layers.attention_sharded import ShardedAttention
from pallas_kernels.ragged_paged_attention import gpu_mgpu, xla

PAGE, HEADS, KV_HEADS, D = 4, 4, 2, 8


def _dense(q, k, v, pos, window, sinks, scale):
    """One request: `q [T, H, D]` at positions `pos`, keys `k, v [L, KV, D]`."""
    group = HEADS // KV_HEADS
    out = np.zeros_like(q)
    for t in range(q.shape[0]):
        for h in range(HEADS):
            keys = [j for j in range(k.shape[0]) if j <= pos[t] and (window is None
                                                                      or j > pos[t] - window)]
            s = np.array([q[t, h] @ k[j, h // group] * scale for j in keys])
            e = np.exp(np.append(s, sinks[h]) - max(s.max(), sinks[h]))
            out[t, h] = (e[:-1, None] * v[keys, h // group]).sum(0) / e.sum()
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_the_xla_body_counts_each_heads_sink_in_its_softmax(window):
    rng = np.random.default_rng(0)
    lens, q_lens = [7, 5], [3, 1]  # a prefill chunk beside a decode
    pages = 1 + 2 * 2
    cache = np.zeros((pages, PAGE, 2 * KV_HEADS, D), np.float32)
    tables = np.array([[1, 2], [3, 4]], np.int32)
    ks, vs = [], []
    for r, n in enumerate(lens):
        k, v = rng.standard_normal((2, n, KV_HEADS, D)).astype(np.float32)
        for j in range(n):
            cache[tables[r, j // PAGE], j % PAGE, 0::2] = k[j]
            cache[tables[r, j // PAGE], j % PAGE, 1::2] = v[j]
        ks.append(k)
        vs.append(v)
    q = rng.standard_normal((sum(q_lens), HEADS, D)).astype(np.float32)
    sinks = np.array([-1.0, 0.5, 2.0, 4.0], np.float32)
    args = (jnp.asarray(q), jnp.asarray(cache), jnp.asarray(lens, jnp.int32),
            jnp.asarray(tables), jnp.asarray([0, 3, 4], jnp.int32), jnp.asarray([2], jnp.int32))
    got = np.asarray(xla.ragged_paged_attention(*args, sm_scale=0.5, sliding_window=window,
                                                sinks=jnp.asarray(sinks)))
    want = np.concatenate([
        _dense(q[:3], ks[0], vs[0], [4, 5, 6], window, sinks, 0.5),
        _dense(q[3:], ks[1], vs[1], [4], window, sinks, 0.5)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = np.asarray(xla.ragged_paged_attention(*args, sm_scale=0.5, sliding_window=window))
    assert np.abs(plain - got).max() > 0.05  # the sinks take weight from every key
    very_low = xla.ragged_paged_attention(*args, sm_scale=0.5, sliding_window=window,
                                          sinks=jnp.full(HEADS, -1e4, jnp.float32))
    np.testing.assert_allclose(np.asarray(very_low), plain, rtol=1e-6, atol=1e-6)


BACKENDS = {"xla": AttentionBackend, "pallas_tpu": PallasTPUBackend,
            "pallas_gpu": PallasGPUBackend}


@dataclasses.dataclass(frozen=True)
class Step:
    md: AttentionMetadata  # slot_mapping: every context position's slot, for write_kv
    q: jax.Array
    k: jax.Array  # [positions, KV, D], the K/V at md.slot_mapping
    v: jax.Array
    sinks: jax.Array
    num_real: int  # query rows before the padding ones
    num_pages: int
    page: int


def _step(seqs, *, kv_heads=2, group=2, d=32, page=8, dtype=jnp.float32, seed=0) -> Step:
    """Requests (q_len, kv_len), then a padded request slot and two padding tokens."""
    rng = np.random.default_rng(seed)
    need = [-(-kv // page) for _, kv in seqs]
    num_pages = sum(need) + 1  # page 0: scratch
    pages = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(seqs) + 1, max(need)), np.int32)
    slots, k = [], 0
    for r, (n, (_, kv)) in enumerate(zip(need, seqs, strict=True)):
        table[r, :n] = pages[k:k + n]
        k += n
        slots += [table[r, p // page] * page + p % page for p in range(kv)]
    cu = np.zeros(len(seqs) + 2, np.int32)
    cu[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
    cu[-1] = cu[-2]
    kv_lens = np.asarray([kv for _, kv in seqs] + [0], np.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots, jnp.int32),
                           kv_lens=jnp.asarray(kv_lens), page_indices=jnp.asarray(table),
                           cu_q_lens=jnp.asarray(cu),
                           num_seqs=jnp.asarray([len(seqs)], jnp.int32))
    heads = kv_heads * group

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return Step(md, normal(int(cu[-1]) + 2, heads, d), normal(len(slots), kv_heads, d),
                normal(len(slots), kv_heads, d),
                jnp.asarray(rng.uniform(-2.0, 4.0, heads), jnp.float32), int(cu[-1]),
                num_pages, page)


def _write_then_attend(backend, step: Step, *, sinks=True, jit=False) -> np.ndarray:
    """The step's K/V written through `backend`, then its queries attended (float32)."""
    kv_heads, d = step.k.shape[1:]
    cache = jnp.zeros(backend.kv_cache_shape(step.num_pages, step.page, kv_heads, d),
                      step.q.dtype)
    cache = backend.write_kv(cache, step.k, step.v, step.md)
    attend = functools.partial(backend.attend, sm_scale=d**-0.5)
    if jit:
        attend = jax.jit(attend)
    with jax.default_matmul_precision("highest"):
        out = attend(step.q, cache, step.md, sinks=step.sinks if sinks else None)
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("name", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.slow
def test_pallas_backends_attend_with_sinks_as_the_xla_body(name):
    """A prompt chunk beside decodes (one over 100 keys: the GPU body splits its KV walk);
    padding rows come back zero."""
    step = _step([(6, 6), (1, 100), (3, 20)])
    want = _write_then_attend(AttentionBackend(), step)
    assert np.abs(want - _write_then_attend(AttentionBackend(), step, sinks=False)).max() > 0.1
    got = _write_then_attend(BACKENDS[name](interpret=True), step)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[step.num_real:], 0.0)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.slow
def test_sharded_attend_splits_the_sinks_with_the_query_heads(name):
    """Tensor parallel 2 (fake CPU devices): each device attends with its own kv head, its
    query heads and their sinks; the answer is the one-device XLA body's."""
    step = _step([(5, 5), (1, 70)], seed=1)
    want = _write_then_attend(AttentionBackend(), step)
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("model",))
    sharded = ShardedAttention(BACKENDS[name](interpret=True), mesh)
    got = _write_then_attend(sharded, step, jit=True)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(gpu_mgpu.plgpu is None, reason="this jax has no Mosaic GPU")
@pytest.mark.slow
def test_the_mosaic_gpu_backend_hands_steps_with_sinks_to_the_triton_body(monkeypatch):
    """A prefill-shaped bf16 step the Mosaic GPU body would take without sinks goes, with
    them, to the Triton body, whose answer is the XLA body's (bf16 bounds)."""
    step = _step([(20, 20), (1, 50), (9, 40)], d=64, page=16, dtype=jnp.bfloat16, seed=2)
    cache = jax.ShapeDtypeStruct((step.num_pages, 4, 16, 64), jnp.bfloat16)
    assert gpu_mgpu.supported(step.q, cache, step.md.page_indices, interpret=True)
    assert not gpu_mgpu.supported(step.q, cache, step.md.page_indices, interpret=True,
                                  sinks=step.sinks)

    def no_mosaic(*args, **kwargs):
        raise AssertionError("a step with sinks reached the Mosaic GPU body")

    monkeypatch.setattr(gpu_mgpu, "_mgpu_call", no_mosaic)
    want = _write_then_attend(AttentionBackend(), step)
    got = _write_then_attend(PallasGPUMosaicBackend(interpret=True), step)
    np.testing.assert_array_equal(got[step.num_real:], 0.0)
    err = got[:step.num_real] - want[:step.num_real]
    assert np.abs(err).max() <= 6e-2
    assert np.linalg.norm(err) <= 1e-2 * np.linalg.norm(want[:step.num_real])
