"""Async scheduling: step N+1 is dispatched before step N's tokens reach the host.

The oracle is the same engine with async scheduling off: every token, logprob
and finish reason must agree, under sampling, preemption, chunked prefill and
aborts, and every block must come back at the end.
"""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from tests.engine.hf_reference import random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size

BASE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, block_size=8, seed=0,
            token_buckets=[16, 64], request_buckets=[4, 8], max_num_batched_tokens=64)

MIXED = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, seed=1, logprobs=2),
    SamplingParams(temperature=1.0, min_p=0.1, max_tokens=7, n=2),
    SamplingParams(temperature=0.0, max_tokens=1),
    SamplingParams(temperature=1.0, max_tokens=9, seed=3, prompt_logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[7, 11, 13]),
]


pytestmark = pytest.mark.slow  # engines with and without async scheduling


@pytest.fixture(scope="module")
def prompts(model_dir):
    vocab = checkpoint_vocab_size(model_dir)
    return random_prompts(vocab, [9, 17, 30, 41, 6, 23], seed=5)


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [{t: lp.logprob for t, lp in d.items()}
                                               for d in c.logprobs]) for c in o.outputs]
            + [o.prompt_logprobs and [d and sorted(d) for d in o.prompt_logprobs]]
            for o in outs]


def _assert_same(got, want):
    """Tokens, finish reasons and logprob keys equal; logprob values to float32 noise.

    A request's logits may be computed in a batch of another shape (a step planned
    differently, or a preempted request recomputed as prefill), which moves float32
    values by an ulp or two; rounding both sides would flip on a digit boundary.
    """
    def split(outs):
        exact, values = [], []
        for req in outs:
            for tokens, reason, stop, lps in req[:-1]:
                exact.append((tokens, reason, stop, lps and [sorted(d) for d in lps]))
                values.extend(v for d in lps or [] for _, v in sorted(d.items()))
            exact.append(req[-1])
        return exact, values

    got_exact, got_values = split(got)
    want_exact, want_values = split(want)
    assert got_exact == want_exact
    assert got_values == pytest.approx(want_values, abs=1e-5, rel=0)


def _record_order(llm: LLM) -> list[str]:
    """Wraps the runner so that the order of dispatches and collects is logged."""
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    events: list[str] = []
    dispatch, collect = runner.dispatch, runner.collect

    def logged_dispatch(so):
        events.append("d")
        return dispatch(so)

    def logged_collect(h):
        events.append("c")
        return collect(h)

    runner.dispatch, runner.collect = logged_dispatch, logged_collect
    return events


@pytest.mark.parametrize("extra", [
    {},
    {"max_num_batched_tokens": 16, "token_buckets": [16]},  # chunked prefill
    {"num_kv_blocks": 14},  # preemption
])
def test_async_equals_sync_for_a_mixed_workload(model_dir, prompts, extra):
    sync = LLM(model_dir, **{**BASE, **extra}, async_scheduling=False)
    ahead = LLM(model_dir, **{**BASE, **extra}, async_scheduling=True)
    events = _record_order(ahead)
    _assert_same(_run(ahead, prompts, MIXED), _run(sync, prompts, MIXED))
    # The run did go ahead: some step was dispatched while another was in flight.
    assert "dd" in "".join(events)
    if "num_kv_blocks" in extra:
        assert ahead.llm_engine.last_stats.num_preemptions > 0
    core = ahead.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == core.config.cache_config.num_blocks - 1


def test_requests_that_read_their_own_outputs_run_ahead_and_equal_sync(model_dir, prompts):
    history = [SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.4,
                              max_tokens=10, seed=2),
               SamplingParams(temperature=0.0, min_tokens=6, max_tokens=8,
                              stop_token_ids=[7, 11]),
               SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=12,
                              ignore_eos=True, bad_words_token_ids=[[5, 9]])]
    sync = LLM(model_dir, **BASE, async_scheduling=False)
    ahead = LLM(model_dir, **BASE, async_scheduling=True)
    events = _record_order(ahead)
    _assert_same(_run(ahead, prompts[:3], history), _run(sync, prompts[:3], history))
    # Penalties, min_tokens and bad words read the outputs on the device: the steps
    # still run ahead, every one dispatched before the one in flight is collected.
    order = "".join(events)
    assert "dd" in order and "cc" not in order


def test_abort_while_a_step_is_in_flight_frees_every_block(model_dir, prompts):
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **BASE,
                                                   skip_tokenizer_init=True))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    core = engine.engine_core.engine_core
    for _ in range(4):
        engine.step()
    assert core._inflight is not None
    engine.abort_request(["1", "2"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["0", "3"]
    assert all(len(o.outputs[0].token_ids) == 40 for o in done.values())
    while core.has_unfinished_requests():
        engine.step()
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == core.config.cache_config.num_blocks - 1
