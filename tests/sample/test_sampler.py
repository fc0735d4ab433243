"""The sampler as the model runner calls it, and its rows: filters, draws, RNG rule,
penalties, masks (the logits processors), logprobs.

The runner samples through `StepPrograms.sample`: one program (logits head and
draw) for a plain step, else the staged sampler (sample/staged.py). The tests
call that, with an identity logits head so that the logits they give are the
logits it samples from, and check it against `sampler.sample` in one piece.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sample import sampler, staged
from jaxllm.sample.metadata import SamplingMetadata, variant_metadata
from jaxllm.sample.rng import key_base_data, rng_key_data, rng_keys
from jaxllm.sample.sampler import SamplerOutput
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.programs import StepPrograms
from jaxllm.worker.sampling_rows import SamplingRows as _SamplingRows
from pallas_kernels.sampling import topk_topp

# Rows the runner's programs have beyond the request bucket (max_num_seqs is larger):
# the sampled ids come back padded to them.
EXTRA_ROWS = 3


def _identity_head(head, hidden):
    return hidden


class RunnerSampler:
    """`StepPrograms.sample` on `logits [R, V]` given as the step's last hidden states.

    `head_logits` keys the programs' cache (`step_functions`) and the staged
    sampler owns its jitted stages: a fresh pair traces afresh.
    """

    def __init__(self, head_logits=_identity_head, staged_sampler=staged.STAGED):
        self.head_logits, self.staged = head_logits, staged_sampler
        self._programs: dict[int, StepPrograms] = {}

    def __call__(self, logits, md: SamplingMetadata) -> SamplerOutput:
        rows = md.temperature.shape[0]
        size = rows + EXTRA_ROWS
        if size not in self._programs:
            buckets = Buckets((16,), (rows,), max_num_seqs=size, max_blocks_per_req=1)
            programs = StepPrograms(None, None, jnp.zeros(1), self.head_logits, buckets, None)
            programs.staged = self.staged
            self._programs[size] = programs
        hidden = jnp.zeros((size, logits.shape[-1]), jnp.float32).at[:rows].set(logits)
        out = self._programs[size].sample(hidden, md)
        assert out.token_ids.shape == (size,)
        if not isinstance(out.token_ids, jax.core.Tracer):
            assert not np.asarray(out.token_ids[rows:]).any()  # the padding rows
        return SamplerOutput(out.token_ids[:rows], out.logprob_token_ids, out.logprobs,
                             out.ranks)


class SamplingRows(_SamplingRows):
    """The runner's sampling rows, with the output counts that InputBatch owns in the
    runner (there the forward hands the sampler each row's output index)."""

    def __init__(self, max_num_reqs, vocab_size):
        super().__init__(max_num_reqs, vocab_size)
        self.num_out = np.zeros(max_num_reqs, np.int32)

    def add(self, row, params, prompt_token_ids, output_token_ids=()):
        super().add(row, params, prompt_token_ids, output_token_ids)
        self.num_out[row] = len(output_token_ids)

    def move(self, src, dst):
        num_out = self.num_out[src]
        super().move(src, dst)
        if src != dst:
            self.num_out[dst], self.num_out[src] = num_out, 0

    def make_metadata(self, rows, padded_size, engine_seed, out_index=None):
        if out_index is None:
            out_index = np.zeros(padded_size, np.int32)
            out_index[:len(rows)] = self.num_out[np.asarray(rows)]
        return super().make_metadata(rows, padded_size, engine_seed, out_index)

    def append_tokens(self, rows, token_ids):
        """What the runner does after a step: the device tables take the sampled ids."""
        rows = np.asarray(rows)
        self.record(rows, np.ones(rows.size, bool), jnp.asarray(token_ids, jnp.int32),
                    rows.size)
        self.num_out[rows] += 1

    def append_token(self, row, token_id):
        self.append_tokens(np.array([row]), np.array([token_id]))

    def num_output_tokens(self, row):
        return int(self.num_out[row])


def output_counts(md):
    """`[R, V]` output counts of the batch rows, read from the device tables."""
    return np.asarray(md.history.tables.counts)[np.asarray(md.history.rows)]


def batch_view(md, n):
    """`md` with the history group's tables gathered at its first `n` rows (padding
    rows: zeros): what the sampler reads for each batch row, whichever table rows
    they sit in."""
    if md.history is None:
        return md
    h = md.history
    rows = np.asarray(h.rows)
    tables = jax.tree.map(lambda t: np.where((np.arange(rows.size) < n).reshape(
        -1, *[1] * (t.ndim - 1)), np.asarray(t)[rows], 0), h.tables)
    return dataclasses.replace(md, history=dataclasses.replace(h, rows=np.arange(rows.size),
                                                               tables=tables))


sample = RunnerSampler()
adjust_logits = staged.STAGED.adjust
one_piece_sample = jax.jit(sampler.sample)


IMPLS = {"sort": ("sort", "lax"), "sort_free": ("threshold", "blocks")}
_impl_fns: dict[str, types.SimpleNamespace] = {}


@pytest.fixture(params=list(IMPLS))
def impl(request, monkeypatch):
    """Each top-k/top-p and top-logprobs implementation the sampler can take.

    "auto" takes the sort and `lax.top_k` on the CPU, so the accelerators'
    sort-free ones ("threshold", "blocks") are forced here. The implementation
    is read at trace time, so each one has its own jitted functions (distinct
    function objects: no trace of the other path is reused).
    """
    topk, logprobs = IMPLS[request.param]
    monkeypatch.setattr(sampler, "TOP_K_TOP_P_IMPL", topk)
    monkeypatch.setattr(sampler, "TOP_LOGPROBS_IMPL", logprobs)
    if request.param not in _impl_fns:
        _impl_fns[request.param] = types.SimpleNamespace(
            name=request.param,
            sample=RunnerSampler(lambda head, hidden: hidden, staged.StagedSampler()),
            one_piece_sample=jax.jit(lambda logits, md: sampler.sample(logits, md)),
            filter_logits=jax.jit(lambda logits, md: sampler.filter_logits(logits, md)),
            prompt_logprobs=jax.jit(lambda logits, ids, k: sampler.compute_prompt_logprobs(
                logits, ids, k), static_argnames="k"))
    return _impl_fns[request.param]


# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_CRIT_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def _metadata(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, greedy=False,
              use_top_k_top_p=True):
    full = lambda v, dt: np.broadcast_to(np.asarray(v, dt), (n,)).copy()
    seeds = np.arange(n) if seeds is None else seeds
    base = key_base_data(np.ones(n, bool), seeds, 0, np.zeros(n))
    return SamplingMetadata(full(temperature, np.float32), full(top_k, np.int32),
                            full(top_p, np.float32), full(min_p, np.float32),
                            full(greedy, bool), base, np.zeros(n, np.int32),
                            use_top_k_top_p=use_top_k_top_p)


def _np_keep(row, temperature, top_k, top_p, min_p):
    """vLLM v1's filters on one row, in float64: min-p, top-k, then top-p."""
    x = np.asarray(row, np.float64) / temperature
    probs = np.exp(x - x.max())
    keep = probs >= min_p * probs.max()
    if 0 < top_k < x.size:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1.0:
        e = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
        order = np.argsort(-x, kind="stable")
        before = np.cumsum(e[order]) - e[order]
        keep_p = np.zeros(x.size, bool)
        keep_p[order] = before < top_p
        keep &= keep_p
    return keep


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_greedy_rows_take_the_argmax_of_the_logits():
    rng = np.random.default_rng(0)
    rows = SamplingRows(8, 100)
    for r in range(6):
        rows.add(r, SamplingParams(temperature=0.0 if r % 2 else 0.8, top_k=5), [1, 2])
    logits = rng.standard_normal((8, 100)).astype(np.float32)
    md = rows.make_metadata(np.arange(6), 8, engine_seed=0)
    got = np.asarray(sample(jnp.asarray(logits), md).token_ids)
    assert np.array_equal(got[1:6:2], logits[1:6:2].argmax(-1))
    all_greedy = rows.make_metadata(np.array([1, 3, 5]), 8, engine_seed=0)
    assert all_greedy.all_greedy and not all_greedy.use_top_k_top_p
    got = np.asarray(sample(jnp.asarray(logits), all_greedy).token_ids)
    assert np.array_equal(got, logits.argmax(-1))


def test_temperature_min_p_top_k_top_p_keep_what_a_numpy_reference_keeps(impl):
    rng = np.random.default_rng(1)
    n, vocab = 48, 64
    logits = (rng.standard_normal((n, vocab)) * 2).astype(np.float32)
    temperature = rng.uniform(0.3, 2.0, n)
    top_k = rng.integers(0, vocab + 2, n)
    top_p = np.where(rng.random(n) < 0.3, 1.0, rng.uniform(0.1, 1.0, n))
    min_p = np.where(rng.random(n) < 0.3, 0.0, rng.uniform(0.0, 0.3, n))
    md = _metadata(n, temperature, top_k, top_p, min_p)
    got = np.asarray(impl.filter_logits(jnp.asarray(logits), md))
    for r in range(n):
        keep = _np_keep(logits[r], temperature[r], top_k[r], top_p[r], min_p[r])
        assert np.array_equal(np.isfinite(got[r]), keep), r
        np.testing.assert_allclose(got[r][keep], logits[r][keep] / np.float32(temperature[r]),
                                   rtol=1e-6)


# The sort-free filter's keep masks are checked row by row above; here its
# draws, on the cases it changes (top-k, top-p), not every case twice.
@pytest.mark.parametrize("impl,temperature,top_k,top_p,min_p", [
    ("sort", 0.7, 0, 1.0, 0.0),
    ("sort", 1.0, 3, 1.0, 0.0),
    ("sort", 1.0, 0, 0.8, 0.0),
    ("sort", 1.0, 0, 1.0, 0.2),
    ("sort", 1.5, 6, 0.9, 0.05),
    ("sort_free", 1.0, 0, 0.8, 0.0),
    ("sort_free", 1.5, 6, 0.9, 0.05),
], indirect=["impl"])
def test_sampled_frequencies_match_the_filtered_softmax(impl, temperature, top_k, top_p,
                                                        min_p):
    draws, vocab = 20_000, 8
    row = np.array([2.0, 1.5, 1.0, 0.5, 0.1, -0.5, -1.0, -2.0], np.float32)
    logits = jnp.asarray(np.tile(row, (draws, 1)))
    md = _metadata(draws, temperature, top_k, top_p, min_p, seeds=np.arange(draws) + 7)
    tokens = np.asarray(impl.sample(logits, md).token_ids)
    counts = np.bincount(tokens, minlength=vocab)
    keep = _np_keep(row, temperature, top_k, top_p, min_p)
    assert counts[~keep].sum() == 0
    probs = np.exp(row[keep] / temperature - (row[keep] / temperature).max())
    expected = draws * probs / probs.sum()
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum()
    assert chi2 < CHI2_CRIT_999[int(keep.sum()) - 1], (chi2, counts, expected)


def _run_steps(rows, batch_rows, padded, logits_for, steps):
    """Samples `steps` tokens for `batch_rows`; returns tokens[step, j]."""
    out = []
    for step in range(steps):
        md = rows.make_metadata(batch_rows, padded, engine_seed=11)
        logits = np.stack([logits_for(r, step) for r in batch_rows] +
                          [np.zeros(32, np.float32)] * (padded - len(batch_rows)))
        tokens = np.asarray(sample(jnp.asarray(logits), md).token_ids)[:len(batch_rows)]
        rows.append_tokens(batch_rows, tokens)
        out.append(tokens)
    return np.array(out)


def test_seeded_request_is_reproducible_and_independent_of_its_row_and_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    same = lambda r, step: np.random.default_rng(step).standard_normal(32).astype(np.float32)
    other = lambda r, step: np.random.default_rng(100 + r * 7 + step).standard_normal(32) \
        .astype(np.float32)
    # Run 1: the seeded request in row 0 of a batch of 3, bucket 4.
    a = SamplingRows(8, 32)
    a.add(0, seeded, [1])
    a.add(1, SamplingParams(temperature=1.0), [1])
    a.add(2, SamplingParams(temperature=0.5, seed=9), [1])
    run1 = _run_steps(a, np.array([0, 1, 2]), 4,
                      lambda r, s: same(r, s) if r == 0 else other(r, s), 8)[:, 0]
    # Run 2: row 5, alone with different neighbours, bucket 8, other engine streams used.
    b = SamplingRows(8, 32)
    for r in range(5):
        b.add(r, SamplingParams(temperature=2.0, top_k=3), [2, 3])
    b.add(5, seeded, [1])
    run2 = _run_steps(b, np.array([3, 5, 1, 0]), 8,
                      lambda r, s: same(r, s) if r == 5 else other(r, s), 8)[:, 1]
    assert np.array_equal(run1, run2)
    assert len(set(run1.tolist())) > 1  # it does sample, not just take the max


def test_unseeded_requests_get_distinct_streams_and_a_seeded_key_depends_on_seed_and_index():
    rows = SamplingRows(4, 32)
    rows.add(0, SamplingParams(), [1])
    rows.add(1, SamplingParams(), [1])
    keys_of = lambda md: np.asarray(rng_keys(md.key_base, md.out_index))
    keys = keys_of(rows.make_metadata(np.array([0, 1]), 2, engine_seed=3))
    assert not np.array_equal(keys[0], keys[1])
    assert np.array_equal(keys, keys_of(rows.make_metadata(np.array([0, 1]), 2, engine_seed=3)))
    assert not np.array_equal(keys, keys_of(rows.make_metadata(np.array([0, 1]), 2, 4)))
    one = lambda seed, i: rng_key_data(np.array([True]), [seed], 99, [5], [i])
    assert np.array_equal(one(7, 3), rng_key_data(np.array([True]), [7], 0, [0], [3]))
    assert not np.array_equal(one(7, 3), one(7, 4)) and not np.array_equal(one(7, 3), one(8, 3))


def test_penalties_follow_vllms_formulas_and_touch_only_seen_tokens():
    vocab = 16
    rows = SamplingRows(4, vocab)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.25)
    rows.add(0, params, prompt_token_ids=[1, 2], output_token_ids=[3])
    rows.add(1, SamplingParams(temperature=0.0), [1, 2, 3])
    rows.append_tokens(np.array([0, 1]), np.array([3, 3]))
    rows.append_token(0, 4)
    md = rows.make_metadata(np.array([0, 1]), 4, engine_seed=0)
    assert md.history is not None and md.fixed is None
    logits = np.linspace(-2, 2, vocab, dtype=np.float32)[None].repeat(4, 0)
    logits[0, 1] = -1.0
    got = np.asarray(adjust_logits(jnp.asarray(logits), md))
    want = logits[0].copy()
    counts = np.bincount([3, 3, 4], minlength=vocab)
    seen = (counts > 0) | np.isin(np.arange(vocab), [1, 2])
    want = np.where(seen, np.where(want > 0, want / 1.5, want * 1.5), want)
    want = want - 0.5 * counts - 0.25 * (counts > 0)
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    assert np.array_equal(got[1:], logits[1:])  # rows without penalties are untouched
    # Only rows in the batch count: without row 0 the part is left out.
    assert rows.make_metadata(np.array([1]), 4, engine_seed=0).history is None


def test_logit_bias_allowed_tokens_bad_words_and_min_tokens_mask_exactly_their_tokens():
    vocab = 12
    rows = SamplingRows(6, vocab)
    rows.add(0, SamplingParams(logit_bias={2: 5.0, 7: -3.0}), [0])
    rows.add(1, SamplingParams(allowed_token_ids=[4, 5], logit_bias={5: 1.0}), [0])
    rows.add(2, SamplingParams(bad_words_token_ids=[[9], [3, 6, 8]]), [0], [6])
    rows.add(3, SamplingParams(min_tokens=2, all_stop_token_ids=[10, 11]), [0])
    rows.add(4, SamplingParams(), [0])
    batch = np.arange(5)
    zeros = jnp.zeros((8, vocab), jnp.float32)
    adjust_of = lambda md: np.asarray(adjust_logits(zeros, md))  # what is added to the logits
    adjust = adjust_of(rows.make_metadata(batch, 8, engine_seed=0))
    changed = lambda r: {int(t): float(adjust[r, t]) for t in np.flatnonzero(adjust[r])}
    assert changed(0) == {2: 5.0, 7: -3.0}
    assert set(np.flatnonzero(np.isfinite(adjust[1]))) == {4, 5} and adjust[1, 5] == 1.0
    assert changed(2) == {9: -np.inf}  # output [6] does not end with the prefix [3, 6]
    assert changed(3) == {10: -np.inf, 11: -np.inf}
    assert not adjust[4].any() and not adjust[5:].any()
    rows.append_tokens(batch, np.array([0, 4, 3, 1, 0]))
    adjust = adjust_of(rows.make_metadata(batch, 8, engine_seed=0))
    assert changed(2) == {9: -np.inf}  # output [6, 3]: prefix [3, 6] still not at the end
    rows.append_tokens(batch, np.array([0, 4, 6, 1, 0]))
    adjust = adjust_of(rows.make_metadata(batch, 8, engine_seed=0))
    assert changed(2) == {9: -np.inf, 8: -np.inf}  # output [6, 3, 6] ends with [3, 6]
    assert changed(3) == {}  # two outputs: min_tokens reached
    # The adjustment reaches the logits before the greedy arg-max.
    logits = np.zeros((8, vocab), np.float32)
    logits[:, 8] = 3.0
    greedy = SamplingRows(2, vocab)
    greedy.add(0, SamplingParams(temperature=0.0, bad_words_token_ids=[[8]]), [0])
    md = greedy.make_metadata(np.array([0]), 8, engine_seed=0)
    assert int(sample(jnp.asarray(logits), md).token_ids[0]) != 8
    # Only min_tokens, and already reached: the device leaves every logit as it is.
    only_min = SamplingRows(2, vocab)
    only_min.add(0, SamplingParams(min_tokens=1, all_stop_token_ids=[1]), [0], [5])
    md = only_min.make_metadata(np.array([0]), 2, engine_seed=0)
    assert md.fixed is None and md.history is not None
    assert not np.asarray(adjust_logits(jnp.zeros((2, vocab)), md)).any()


def test_logprobs_and_ranks_are_the_raw_log_softmax(impl):
    rng = np.random.default_rng(5)
    vocab = 6000  # > 2 * 20 blocks: "blocks" does not fall back to lax.top_k
    assert -(-vocab // topk_topp.TOP_K_BLOCK) > 2 * MAX_LOGPROBS
    rows = SamplingRows(4, vocab)
    rows.add(0, SamplingParams(temperature=1.0, logprobs=3, logit_bias={0: 50.0}), [1])
    rows.add(1, SamplingParams(temperature=0.0), [1])
    md = rows.make_metadata(np.array([0, 1]), 4, engine_seed=0)
    assert md.num_logprobs == MAX_LOGPROBS
    logits = (rng.standard_normal((4, vocab)) * 3).astype(np.float32)
    out = impl.sample(jnp.asarray(logits), md)
    lp = _np_log_softmax(logits)  # raw: the bias of row 0 does not show here
    ids, got = np.asarray(out.logprob_token_ids), np.asarray(out.logprobs)
    assert ids.shape == (4, MAX_LOGPROBS + 1) and int(out.token_ids[0]) == 0
    assert np.array_equal(ids[:, 0], np.asarray(out.token_ids))
    assert np.array_equal(ids[:, 1:], np.argsort(-lp, axis=-1, kind="stable")[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(got, np.take_along_axis(lp, ids, -1), atol=1e-5)
    ranks = (lp >= np.take_along_axis(lp, ids[:, :1], -1)).sum(-1)
    assert np.array_equal(np.asarray(out.ranks), ranks) and out.ranks[1] == 1


def _sorted_widths(fn, *args) -> set[int]:
    """Lengths of the axes that the sorts and top_ks in `fn`'s jaxpr (nested too) work along."""
    widths: set[int] = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("sort", "top_k"):
                axis = eqn.params.get("dimension", eqn.params.get("axis", -1))
                widths.add(eqn.invars[0].aval.shape[axis])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return widths


def test_the_sort_free_paths_never_sort_or_top_k_a_whole_vocab_row(impl):
    vocab = 6000
    rows = SamplingRows(4, vocab)
    rows.add(0, SamplingParams(temperature=1.0, top_k=5, top_p=0.9, logprobs=3), [1])
    md = rows.make_metadata(np.array([0]), 4, engine_seed=0)
    assert md.use_top_k_top_p and md.num_logprobs == MAX_LOGPROBS
    widths = _sorted_widths(impl.sample, jnp.zeros((4, vocab), jnp.float32), md)
    assert (vocab in widths) == (impl.name == "sort"), widths


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_score_the_targets_with_their_ranks(k, impl):
    rng = np.random.default_rng(6)
    vocab = 1000  # > 2 * 3 blocks: "blocks" does not fall back to lax.top_k
    logits = rng.standard_normal((7, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, 7)
    ids, got, ranks = (np.asarray(a) for a in impl.prompt_logprobs(
        jnp.asarray(logits), jnp.asarray(targets), k=k))
    lp = _np_log_softmax(logits)
    assert ids.shape == (7, k + 1) and np.array_equal(ids[:, 0], targets)
    assert np.array_equal(ids[:, 1:], np.argsort(-lp, axis=-1)[:, :k])
    np.testing.assert_allclose(got, np.take_along_axis(lp, ids, -1), atol=1e-5)
    assert np.array_equal(ranks, (lp >= lp[np.arange(7), targets][:, None]).sum(-1))


def test_rows_add_remove_move_keep_state_and_build_optional_parts_only_when_needed():
    vocab = 20
    rows = SamplingRows(6, vocab)
    pen = SamplingParams(temperature=0.9, top_k=4, top_p=0.5, min_p=0.1, seed=3,
                         presence_penalty=1.0, logprobs=2)
    rows.add(2, pen, [5, 6], [7])
    rows.add(4, SamplingParams(temperature=0.0), [1])
    before = rows.make_metadata(np.array([2, 4]), 4, engine_seed=0)
    before_rows, before = np.asarray(before.history.rows), batch_view(before, 2)
    assert before.history is not None and before.num_logprobs == MAX_LOGPROBS
    assert not before.all_greedy and before.use_top_k_top_p and before.fixed is None
    np.testing.assert_allclose(before.temperature, [0.9, 1.0, 1.0, 1.0])
    assert before.top_k.tolist() == [4, 0, 0, 0] and before.greedy.tolist() == [0, 1, 1, 1]
    rows.move(2, 0)  # condense
    assert not rows.is_active(2) and rows.is_active(0) and rows.num_output_tokens(0) == 1
    after = rows.make_metadata(np.array([0, 4]), 4, engine_seed=0)
    assert jax.tree_util.tree_structure(after) == jax.tree_util.tree_structure(before)
    assert before_rows.tolist()[:2] == [2, 4]
    assert np.asarray(after.history.rows).tolist()[:2] == [0, 4]  # the moved table row
    after = batch_view(after, 2)
    for x, y in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after),
                    strict=True):
        assert np.array_equal(x, y)
    assert output_counts(after)[0].tolist() == np.bincount([7], minlength=vocab).tolist()
    rows.remove(0)
    plain = rows.make_metadata(np.array([4]), 4, engine_seed=0)
    assert plain.history is None and plain.fixed is None and plain.num_logprobs == 0
    assert plain.all_greedy and not plain.use_top_k_top_p
    # Vectorized appends equal one-at-a-time appends.
    a, b = SamplingRows(4, vocab), SamplingRows(4, vocab)
    for r in (a, b):
        r.add(1, SamplingParams(bad_words_token_ids=[[1, 2, 3]]), [0])
        r.add(3, SamplingParams(frequency_penalty=1.0), [0])
    for step in range(70):  # past the initial output buffer
        a.append_tokens(np.array([3, 1]), np.array([step % 20, (step + 1) % 20]))
        b.append_token(1, (step + 1) % 20)
        b.append_token(3, step % 20)
    ma, mb = (r.make_metadata(np.array([1, 3]), 2, engine_seed=0) for r in (a, b))
    assert np.array_equal(output_counts(ma), output_counts(mb))
    assert output_counts(ma)[1].sum() == 70


def test_variants_are_the_documented_set_and_each_compiles_and_runs():
    variants = list(variant_metadata(4, 32))
    assert len({jax.tree_util.tree_structure(md) for md in variants}) == len(variants) == 48
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32)), jnp.float32)
    for md in variants[::7]:  # a few; compiling all 48 is left to the runner's warm-up
        out = sample(logits, md)
        assert out.token_ids.shape == (4,)
        assert (out.logprobs is None) == (md.num_logprobs == 0)


def test_rng_keys_follow_the_documented_splitmix_derivation_at_any_output_index():
    """The keys are made on the device in 32-bit words; they must equal splitmix64 done
    in Python integers, for seeds and indices that carry across every word boundary."""
    mask = (1 << 64) - 1

    def mix(x):  # splitmix64's finalizer, in Python integers
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    rng = np.random.default_rng(0)
    seeds = [0, 1, 1234, mask, 1 << 63] + rng.integers(0, 2**64, 59, np.uint64).tolist()
    index = [0, 1, 17, 65535, 65536, 10**9, 2**31 - 1] + rng.integers(0, 2**31, 57).tolist()
    want = []
    for seed, i in zip(seeds, index, strict=True):
        h = mix(mix(seed ^ 0x9E3779B97F4A7C15) ^ mix(i ^ 0x8CB92BA72F3D8DD7))
        want.append([h >> 32, h & 0xFFFFFFFF])
    got = rng_key_data(np.ones(len(seeds), bool), seeds, 0, np.zeros(len(seeds)), index)
    assert got.dtype == np.uint32 and got.tolist() == want
    # Unseeded rows: the engine seed and the row's stream make the base.
    eng, stream = 2**64 - 5, 77
    base = mix(mix(eng ^ 0xD1B54A32D192ED03) ^ stream)
    h = mix(base ^ mix(3 ^ 0x8CB92BA72F3D8DD7))
    assert rng_key_data(np.zeros(1, bool), [0], eng, [stream], [3]).tolist() \
        == [[h >> 32, h & 0xFFFFFFFF]]


@pytest.mark.parametrize("t,rows", [(10, 4), (12, 4), (5, 8)])
def test_prompt_logprobs_in_chunks_equal_one_pass(t, rows):
    """Chunked scoring (the last chunk padded, or a single pass when t <= rows)
    gives each position the result of scoring all positions at once."""
    rng = np.random.default_rng(t)
    hidden = jnp.asarray(rng.standard_normal((t, 16)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((300, 16)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 300, t), jnp.int32)
    logits_fn = lambda h: h @ head.T  # noqa: E731
    want = sampler.compute_prompt_logprobs(logits_fn(hidden), targets, 3)
    got = jax.jit(lambda h, tg: sampler.compute_prompt_logprobs_chunked(
        logits_fn, h, tg, 3, rows))(hidden, targets)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def _mixed_rows(vocab):
    """Rows of every kind the sampler tells apart: greedy, random, top-k/top-p, min-p,
    penalties, logit bias, allowed tokens, bad words, min_tokens, logprobs."""
    rows = SamplingRows(16, vocab)
    kinds = [SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.9, seed=1),
             SamplingParams(temperature=1.3, top_k=5, top_p=0.8, seed=2),
             SamplingParams(temperature=0.7, min_p=0.2),
             SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3,
                            presence_penalty=0.2),
             SamplingParams(temperature=1.0, logit_bias={3: 4.0, 9: -2.0}, seed=5),
             SamplingParams(temperature=1.0, allowed_token_ids=[2, 4, 6, 8], seed=6),
             SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [1, 2]]),
             SamplingParams(temperature=0.8, min_tokens=3, all_stop_token_ids=[0, 1]),
             SamplingParams(temperature=0.6, top_p=0.9, logprobs=4, seed=9)]
    for r, params in enumerate(kinds):
        rows.add(r, params, [1, 2, 3], [4, 1])
    return rows, len(kinds)


@pytest.mark.parametrize("batch", [
    [0],  # all greedy: the one-program path
    [1, 3, 2, 0],  # random, min-p, top-k/top-p: the one-program path
    [4, 5, 6, 7, 8],  # penalties and logit adjustments: staged
    list(range(10)),  # everything at once, logprobs too: staged
])
def test_the_runners_sampler_equals_the_sampler_in_one_piece(batch):
    """Whichever path the runner's programs take (one program, or the staged
    adjust / draw / logprobs), they compute `sampler.sample`: the same tokens,
    logprobs and ranks, for every kind of row."""
    vocab = 40
    rows, _ = _mixed_rows(vocab)
    batch = np.array(batch)
    md = rows.make_metadata(batch, 12, engine_seed=3)
    plain = md.history is None and md.fixed is None and not md.num_logprobs
    assert staged.is_plain(md) == plain
    rng = np.random.default_rng(len(batch))
    for step in range(2):
        logits = jnp.asarray(rng.standard_normal((12, vocab)) * 2, jnp.float32)
        got, want = sample(logits, md), one_piece_sample(logits, md)
        assert np.array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids)), step
        assert (got.logprobs is None) == (want.logprobs is None) == (md.num_logprobs == 0)
        if want.logprobs is not None:
            assert np.array_equal(np.asarray(got.logprob_token_ids),
                                  np.asarray(want.logprob_token_ids))
            np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs),
                                       rtol=1e-6, atol=1e-6)
            assert np.array_equal(np.asarray(got.ranks), np.asarray(want.ranks))
        rows.append_tokens(batch, np.asarray(got.token_ids)[:batch.size])
        md = rows.make_metadata(batch, 12, engine_seed=3)


def test_the_staged_sampler_compiles_each_stage_once_per_variant_it_meets():
    """Precompiling over every variant leaves nothing to compile for a real step."""
    vocab, size = 32, 4 + EXTRA_ROWS
    fresh = staged.StagedSampler()
    logits = jnp.zeros((4, vocab), jnp.float32)
    rows, _ = _mixed_rows(vocab)
    # The runner's output tables, as the runner's precompile passes them.
    fresh.precompile(logits, list(variant_metadata(4, vocab, tables=rows.outputs.tables)), size)
    compiled = {name: getattr(fresh, name)._cache_size()
                for name in ("_adjust", "_draw", "_logprobs")}
    # Adjust: every non-empty subset of the fixed and history processor groups and the
    # token bitmask; draw: the three modes; logprobs: one.
    assert compiled == {"_adjust": 7, "_draw": 3, "_logprobs": 1}
    # Penalties, a logit bias, logprobs and top-k/top-p: every stage runs.
    md = rows.make_metadata(np.array([4, 5, 9, 2]), 4, engine_seed=0)
    assert md.history is not None and md.fixed is not None and md.num_logprobs
    out = fresh(logits, md, size)
    assert out.token_ids.shape == (size,) and out.logprobs.shape == (4, MAX_LOGPROBS + 1)
    assert {name: getattr(fresh, name)._cache_size()
            for name in ("_adjust", "_draw", "_logprobs")} == compiled
