"""Attention sinks (GPT-OSS) in the XLA body: each query head's learned logit joins its
softmax as a key without a value; held to a dense numpy softmax with the extra column."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.errors import ParameterError
from jaxllm.layers.attention import AttentionMetadata, get_attention_backend
from pallas_kernels.ragged_paged_attention import xla

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


def test_a_pallas_body_without_sinks_names_the_backend_to_use():
    md = AttentionMetadata(slot_mapping=jnp.zeros(1, jnp.int32), kv_lens=jnp.ones(1, jnp.int32),
                           page_indices=jnp.zeros((1, 1), jnp.int32),
                           cu_q_lens=jnp.array([0, 1], jnp.int32), num_seqs=jnp.ones(1, jnp.int32))
    backend = get_attention_backend("pallas_gpu", interpret=True)
    with pytest.raises(ParameterError, match="attention_backend.*'xla'"):
        backend.attend(jnp.zeros((1, HEADS, 16)), jnp.zeros((2, 2 * KV_HEADS, PAGE, 16)), md,
                       sm_scale=1.0, sinks=jnp.zeros(HEADS))
