"""The sampler over vocab-parallel logits (tp=2) samples what it samples at tp=1 on the
same path: the same tokens for the same keys under greedy, random and top-k/top-p
rows, and the same logprobs, top logprobs and ranks; directly, and through the
engine on the demo model (reference attention), with no compilation after warm-up.

At tp > 1 top-k/top-p always takes the threshold search (a sort would gather the
rows), so tp=1 runs it here too; the CPU's default at tp=1 is the sort, which may
keep a different part of a tie at the top-p cut (sort_topk.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm import LLM, SamplingParams
from jaxllm.sample import sampler, staged
from jaxllm.sample.metadata import SamplingMetadata
from tests.compilations import recorded_compilations

pytestmark = pytest.mark.slow  # the sampler's stages compile at tp=1 and at tp=2

VOCAB, ROWS = 256, 8


def _mesh(tp: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:tp], dtype=object), ("model",),
                axis_types=(AxisType.Auto,))


def _logits(rng: np.random.Generator) -> np.ndarray:
    logits = rng.normal(0, 3, (ROWS, VOCAB)).astype(np.float32)
    logits[1, 100:110] = logits[1].max()  # a tie at the top, across both halves
    logits[2, 120:136] = 4.0  # a tied group straddling the shards' boundary
    logits[3, ::7] = -np.inf  # masked tokens (a bitmask or allowed ids)
    return logits


def _metadata(rng: np.random.Generator, out_index: int) -> SamplingMetadata:
    greedy = np.array([1, 0, 0, 0, 0, 0, 0, 1], bool)
    return SamplingMetadata(
        temperature=np.where(greedy, 1.0, [1, 0.7, 1.3, 1, 0.5, 2.0, 1, 1]).astype(np.float32),
        top_k=np.array([0, 5, 12, 0, 40, 3, 0, 0], np.int32),
        top_p=np.array([1, 0.9, 1, 0.6, 0.95, 1, 0.8, 1], np.float32),
        min_p=np.array([0, 0, 0.05, 0, 0, 0, 0.1, 0], np.float32),
        greedy=greedy,
        key_base=rng.integers(0, 2**32, (ROWS, 2), dtype=np.uint32),
        out_index=np.full(ROWS, out_index, np.int32),
        use_top_k_top_p=True)


def _run(tp: int, logits: np.ndarray, mds: list[SamplingMetadata]) -> list:
    on_mesh = jax.device_put(jnp.asarray(logits), NamedSharding(_mesh(tp), P(None, "model")))
    fresh = staged.StagedSampler()  # traces of its own, under the impl set by the caller
    outs = [fresh(on_mesh, md, ROWS) for md in mds]
    return [jax.tree.map(np.asarray, (o.token_ids, o.logprob_token_ids, o.logprobs, o.ranks))
            for o in outs]


@pytest.fixture
def threshold_impl(monkeypatch):
    monkeypatch.setattr(sampler, "TOP_K_TOP_P_IMPL", "threshold")


def test_tp2_samples_the_tokens_and_logprobs_tp1_samples_on_the_threshold_path(threshold_impl):
    rng = np.random.default_rng(0)
    logits = _logits(rng)
    mds = []
    for step in range(6):  # a fresh key per row and step: many draws per filter
        md = _metadata(rng, step)
        mds += [md, SamplingMetadata(**{**md.__dict__, "num_logprobs": 5})]
    one, two = _run(1, logits, mds), _run(2, logits, mds)
    for (t1, ids1, lp1, r1), (t2, ids2, lp2, r2) in zip(one, two, strict=True):
        np.testing.assert_array_equal(t1, t2)
        if ids1 is not None:
            np.testing.assert_array_equal(ids1, ids2)
            np.testing.assert_allclose(lp1, lp2, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(r1, r2)
    drawn = np.stack([t for t, *_ in one])
    assert len({tuple(c) for c in drawn[:, 1:7].T}) > 1  # the random rows do vary by step


def test_tp2_top_logprobs_equal_lax_top_k_over_the_whole_row_ties_included():
    rng = np.random.default_rng(1)
    x = np.round(rng.normal(0, 1, (ROWS, VOCAB)), 1).astype(np.float32)  # many ties
    on_mesh = jax.device_put(jnp.asarray(x), NamedSharding(_mesh(2), P(None, "model")))
    values, ids = jax.jit(lambda a: sampler._top_largest(a, 20))(on_mesh)
    want_values, want_ids = jax.lax.top_k(jnp.asarray(x), 20)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


def _engine_outputs(tp: int, params: list[SamplingParams], prompts: list[list[int]],
                    warm_up: bool) -> list:
    llm = LLM(None, tensor_parallel_size=tp, dtype="float32", max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=16, block_size=8, token_buckets=[16],
              request_buckets=[4], seed=0, precompile=warm_up)
    try:
        with recorded_compilations() as compiles:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
        if warm_up:
            assert compiles == []
        return [(o.outputs[0].token_ids,
                 [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]
    finally:
        llm.llm_engine.shutdown()


def test_engine_at_tp2_samples_top_k_top_p_as_at_tp1_and_compiles_nothing_after_warm_up(
        threshold_impl):
    jax.clear_caches()  # traces made under the CPU's default (the sort) would be reused
    common = dict(max_tokens=8, ignore_eos=True, logprobs=3)
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=11, **common),
              SamplingParams(temperature=1.2, top_p=0.7, seed=12, **common),
              SamplingParams(temperature=1.0, top_k=3, **common),  # the engine's seed
              SamplingParams(temperature=0.0, **common)]
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
    two = _engine_outputs(2, params, prompts, warm_up=True)
    one = _engine_outputs(1, params, prompts, warm_up=False)
    assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]
    for (_, lp2), (_, lp1) in zip(two, one, strict=True):
        assert [d.keys() for d in lp2] == [d.keys() for d in lp1]
        for d2, d1 in zip(lp2, lp1, strict=True):
            # The tp=2 forward adds its row-parallel partial sums in another order.
            np.testing.assert_allclose(list(d2.values()), list(d1.values()), rtol=1e-5,
                                       atol=1e-5)
    assert len({tuple(tokens) for tokens, _ in two[:3]}) == 3  # the draws differ by request
