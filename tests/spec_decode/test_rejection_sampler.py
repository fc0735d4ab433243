"""The rejection sampler keeps the target distribution exactly and greedy output unchanged.

Many requests with the same logits and different seeds are one batch of
independent samples: the first emitted token must follow the target's
position-0 distribution whatever the drafts, and, where the first draft was
accepted, the second must follow position 1's. Thresholds: chi-square at
p = 1e-4 (chi_square.py) with fixed seeds.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sample import rejection_sampler
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.rejection_sampler import rejection_sample
from jaxllm.sample.rng import key_base_data
from jaxllm.sample.sampler import draw
from tests.spec_decode.chi_square import chi2_threshold, goodness_of_fit

N, V, K = 20000, 8, 2
LOGITS = np.log(np.array([
    [0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02],  # position 0
    [0.05, 0.10, 0.40, 0.20, 0.10, 0.05, 0.05, 0.05],  # position 1 (after draft 0)
    [0.125] * 8,  # bonus position
], np.float32))
DRAFTS = np.array([1, 3], np.int32)  # p0(1) = 0.25: accepted about a quarter of the time


def metadata(n: int, greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
             seed0: int = 0) -> SamplingMetadata:
    seeds = np.arange(seed0, seed0 + n, dtype=np.uint64)
    return SamplingMetadata(
        np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
        np.ones(n, np.float32), np.zeros(n, np.float32), np.full(n, greedy),
        key_base_data(np.ones(n, bool), seeds, 0, np.zeros(n, np.uint64)),
        np.zeros(n, np.int32), all_greedy=greedy, use_top_k_top_p=top_k > 0)


def run(md: SamplingMetadata, draft_probs=None, num_drafts: int = K, logits=LOGITS,
        drafts=None):
    """Samples every row; drafts are DRAFTS, or `drafts` `[n, K]` (drawn from
    `draft_probs` `[K, V]`, the draft distribution of every row)."""
    n = md.temperature.shape[0]
    flat = jnp.tile(jnp.asarray(logits), (n, 1))
    drafts = jnp.tile(jnp.asarray(DRAFTS), (n, 1)) if drafts is None else jnp.asarray(drafts)
    counts = jnp.full(n, num_drafts, jnp.int32)
    probs = None if draft_probs is None else jnp.tile(jnp.asarray(draft_probs), (n, 1, 1))
    # A fresh callable: no trace of another test (one with a planted bug) is reused.
    tokens, emitted = jax.jit(functools.partial(rejection_sample))(flat, drafts, counts, md,
                                                                   probs)
    return np.asarray(tokens), np.asarray(emitted)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def assert_fits(tokens: np.ndarray, probs: np.ndarray) -> None:
    stat, df = goodness_of_fit(np.bincount(tokens, minlength=V), probs)
    assert stat < chi2_threshold(df), (stat, df, np.bincount(tokens, minlength=V) / len(tokens))


def first_two_statistics(tokens: np.ndarray, drafts=DRAFTS) -> list[tuple[float, int]]:
    """First token against p0; second against p1 where the first draft was accepted
    (a rejected draft is never re-emitted: the residual has no mass on it)."""
    drafts = np.broadcast_to(drafts, (tokens.shape[0], K))
    second = tokens[tokens[:, 0] == drafts[:, 0], 1]
    return [goodness_of_fit(np.bincount(tokens[:, 0], minlength=V), softmax(LOGITS[0])),
            goodness_of_fit(np.bincount(second, minlength=V), softmax(LOGITS[1]))]


@pytest.mark.parametrize("draft_probs", [None, softmax(np.array(
    [[0.0, 2.5, 1.0, 0.0, -1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, 2.5, 0.0, 0.0, 0.0, 1.0]],
    np.float32))], ids=["one-hot (ngram) drafts", "draft-model distribution"])
def test_first_and_second_tokens_follow_the_target_distribution(draft_probs):
    drafts = None
    if draft_probs is not None:  # a draft model samples its drafts from q
        rng = np.random.default_rng(0)
        drafts = np.stack([rng.choice(V, N, p=q / q.sum()) for q in draft_probs], 1)
    tokens, emitted = run(metadata(N), draft_probs, drafts=drafts)
    assert ((emitted >= 1) & (emitted <= K + 1)).all()
    assert 0.1 < (emitted > 1).mean() < 0.9  # both branches well exercised
    for stat, df in first_two_statistics(tokens, DRAFTS if drafts is None else drafts):
        assert stat < chi2_threshold(df), (stat, df)


def test_a_biased_acceptance_fails_the_chi_square_test(monkeypatch):
    """The test above catches a sampler that accepts drafts too often."""
    honest = rejection_sampler._uniforms
    monkeypatch.setattr(rejection_sampler, "_uniforms", lambda keys: 0.7 * honest(keys))
    tokens, _ = run(metadata(N))
    stat, df = goodness_of_fit(np.bincount(tokens[:, 0], minlength=V), softmax(LOGITS[0]))
    assert stat > chi2_threshold(df)


def test_a_residual_that_keeps_the_draft_fails_the_chi_square_test(monkeypatch):
    """A rejected draft resampled from p itself (not norm(max(0, p - q))) is caught."""
    monkeypatch.setattr(rejection_sampler.jax.nn, "one_hot",
                        lambda ids, v, dtype: jnp.zeros((*ids.shape, v), dtype))
    tokens, _ = run(metadata(N))
    stat, df = goodness_of_fit(np.bincount(tokens[:, 0], minlength=V), softmax(LOGITS[0]))
    assert stat > chi2_threshold(df)


def test_greedy_accepts_while_the_draft_is_the_argmax():
    # argmax: position 0 -> 0, position 1 -> 2, bonus -> 0.
    for drafts, want in (([0, 2], [0, 2, 0]), ([0, 5], [0, 2, -1]), ([4, 2], [0, -1, -1])):
        global DRAFTS
        saved, DRAFTS = DRAFTS, np.array(drafts, np.int32)
        try:
            tokens, emitted = run(metadata(3, greedy=True))
        finally:
            DRAFTS = saved
        assert tokens.tolist() == [want] * 3
        assert emitted.tolist() == [sum(t >= 0 for t in want)] * 3


def test_a_request_without_drafts_draws_what_the_plain_sampler_draws():
    md = metadata(512)
    tokens, emitted = run(md, num_drafts=0)
    assert (emitted == 1).all() and (tokens[:, 1:] == -1).all()
    plain = np.asarray(draw(jnp.tile(jnp.asarray(LOGITS[0]), (512, 1)), md))
    assert (tokens[:, 0] == plain).all()


def test_filtered_out_tokens_are_never_emitted():
    tokens, _ = run(metadata(4000, top_k=2))
    # Position 0 keeps tokens 0 and 1; position 1 keeps 2 and 3; the bonus keeps ties.
    assert set(tokens[:, 0].tolist()) <= {0, 1}
    assert set(tokens[tokens[:, 0] == 1, 1].tolist()) <= {2, 3}
    assert_fits(tokens[:, 0], softmax(np.where(np.arange(V) < 2, LOGITS[0], -np.inf)))
