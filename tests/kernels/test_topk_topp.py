"""The sort-free top-k / top-p threshold search against the sort reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sampling import sort_topk, topk_topp


@functools.partial(jax.jit, static_argnames="bits")
def _threshold_mask(logits, top_k, top_p, bits):
    return topk_topp.top_k_top_p_mask(logits, top_k, top_p, bits_per_round=bits)


_reference_mask = jax.jit(sort_topk.top_k_top_p_mask)


def _knobs(rng, rows, vocab):
    top_k = rng.integers(0, vocab + 3, rows)
    top_p = rng.uniform(0.02, 1.0, rows)
    top_k[:4] = [1, vocab, vocab + 7, 0]  # k=1, k>=V (off), k=0 (off) ...
    top_p[:4] = 1.0  # ... with top-p off
    top_k[4:8] = 0
    top_p[4:8] = [1.0, 1e-6, 0.999, 1.0]
    return jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)


def test_sortable_key_orders_like_floats():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-30, 30, 500),
                        [0.0, -0.0, np.inf, -np.inf, 1e-37, -1e-37]]).astype(np.float32)
    # (XLA flushes denormals to zero, so they are left out: they key as 0.0.)
    keys = np.asarray(topk_topp.sortable_key(jnp.asarray(x)))
    i, j = np.meshgrid(np.arange(x.size), np.arange(x.size))
    assert np.array_equal(x[i] < x[j], keys[i] < keys[j])
    assert np.array_equal(x[i] == x[j], keys[i] == keys[j])  # -0.0 == 0.0


@pytest.mark.parametrize("bits", [1, 4])  # 2 is covered by the masked-token test
def test_threshold_search_equals_sort_reference_on_distinct_logits(bits):
    rng = np.random.default_rng(bits)
    rows, vocab = 48, 300
    logits = jnp.asarray(rng.standard_normal((rows, vocab)) * 3, jnp.float32)
    top_k, top_p = _knobs(rng, rows, vocab)
    got = np.asarray(_threshold_mask(logits, top_k, top_p, bits))
    want = np.asarray(_reference_mask(logits, top_k, top_p))
    assert np.array_equal(got, want)
    assert got[0].sum() == 1 and got[1:5].all() and got[7].all() and got[5].sum() == 1


def test_top_k_with_ties_keeps_every_token_tied_with_the_kth_like_the_reference():
    rng = np.random.default_rng(1)
    rows, vocab = 40, 200
    logits = jnp.asarray(rng.integers(-4, 5, (rows, vocab)), jnp.float32)  # many ties
    top_k = jnp.asarray(rng.integers(1, vocab, rows), jnp.int32)
    top_p = jnp.ones(rows, jnp.float32)
    got = np.asarray(_threshold_mask(logits, top_k, top_p, 4))
    assert np.array_equal(got, np.asarray(_reference_mask(logits, top_k, top_p)))
    assert (got.sum(-1) >= np.asarray(top_k)).all()


def test_top_p_with_ties_keeps_the_whole_tied_group_at_the_cut():
    rng = np.random.default_rng(2)
    rows, vocab = 40, 200
    logits = np.asarray(rng.integers(-3, 4, (rows, vocab)), np.float32) / 2
    top_k = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)
    top_p = jnp.asarray(rng.uniform(0.05, 0.95, rows), jnp.float32)
    got = np.asarray(_threshold_mask(jnp.asarray(logits), top_k, top_p, 4))
    want = np.asarray(_reference_mask(jnp.asarray(logits), top_k, top_p))
    assert (got >= want).all()  # a superset ...
    for r in range(rows):  # ... differing only by tokens tied with the reference's cut
        cut = logits[r][want[r]].min()
        assert (logits[r][got[r] & ~want[r]] == cut).all()
        assert np.array_equal(got[r], logits[r] >= cut)


def test_masked_tokens_and_large_k_keep_everything_finite():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((8, 64)).astype(np.float32)
    logits[:, 10:] = -np.inf  # e.g. outside allowed_token_ids
    top_k = jnp.asarray([1, 5, 10, 20, 40, 63, 0, 30], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 1.0, 0.9, 0.5, 1.0, 0.3, 1.0], jnp.float32)
    got = np.asarray(_threshold_mask(jnp.asarray(logits), top_k, top_p, 2))
    want = np.asarray(_reference_mask(jnp.asarray(logits), top_k, top_p))
    finite = np.isfinite(logits)
    assert np.array_equal(got & finite, want & finite)


def test_threshold_search_matches_a_numpy_top_k_top_p():
    rng = np.random.default_rng(4)
    rows, vocab = 16, 100
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    top_k, top_p = _knobs(rng, rows, vocab)
    got = np.asarray(_threshold_mask(jnp.asarray(logits), top_k, top_p, 4))
    for r in range(rows):
        x = logits[r].astype(np.float64)
        k, p = int(top_k[r]), float(top_p[r])
        keep = x >= np.sort(x)[::-1][k - 1] if 0 < k < vocab else np.ones(vocab, bool)
        e = np.where(keep, np.exp(x - x.max()), 0.0)
        order = np.argsort(-x)
        before = np.cumsum(e[order] / e.sum()) - e[order] / e.sum()
        keep_p = np.zeros(vocab, bool)
        keep_p[order] = before < p
        assert np.array_equal(got[r], keep & (keep_p | (p >= 1.0))), r


@pytest.mark.parametrize("vocab,block,k", [(1000, 16, 20), (1003, 16, 20), (640, 32, 5)])
def test_blockwise_top_k_equals_lax_top_k_including_ties(vocab, block, k):
    rng = np.random.default_rng(vocab)
    x = jnp.asarray(rng.integers(-50, 8, (12, vocab)), jnp.float32)  # ties at the top
    fn = jax.jit(functools.partial(topk_topp.top_k_largest, k=k, block=block))
    values, ids = fn(x)
    want_values, want_ids = sort_topk.top_k_largest(x, k)
    assert np.array_equal(np.asarray(values), np.asarray(want_values))
    assert np.array_equal(np.asarray(ids), np.asarray(want_ids))
