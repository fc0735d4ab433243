"""Speculative decoding with a hybrid target: a tiny Gemma 2 whose sliding-window layers
(window 8, blocks of 4) let go of the KV blocks their window passed while requests
draft, verify and roll back rejected drafts. The oracle is the same engine without
speculation, token for token, under chunked prefill, prefix-cache hits and
preemption, with ngram drafts and with draft models sharing its vocabulary: the
target itself and a noisy copy (hybrid drafts, reading the full-attention group's
blocks for every layer) and an unrelated one-layer Llama. Before every step each
running request, its rejected drafts rolled back, must still hold the blocks its
next query reads in the sliding-window group; a planted bug that lets go of them
by the optimistic count (every draft accepted) must be caught.

The helpers and fixtures are the ngram and draft-model tests' (test_spec_decode.py,
test_spec_draft_model.py); `model_dir` here is the Gemma 2 target.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.errors import ParameterError
from jaxllm.kv_groups import KVCacheGroups
from jaxllm.worker.draft_model import DraftModel
from tests.engine import test_spec_decode as ngram_tests
from tests.engine import test_spec_draft_model as draft_tests
from tests.engine.test_sliding_window_engine import CASES
from tests.engine.test_spec_decode import (
    SPEC,
    _assert_same,
    _record_spec_stats,
    _run,
    _totals,
    assert_no_compilation_while_speculating,
)
from tests.engine.test_spec_draft_model import _reference, rerun_with_prefix_hits, spec_config
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.own_process import isolated, run_in_own_process

# Prompts that repeat themselves (ngram drafts find matches), two sharing a prefix.
prompts = ngram_tests.prompts
# The target itself, a noisy copy of it, and a random one-layer Llama.
drafts = draft_tests.drafts

ENGINE = dict(ngram_tests.BASE, block_size=4, max_model_len=96, precompile=False)
SETTINGS = {
    "plain": {},
    "whole-prompts": ngram_tests.WHOLE,
    # vLLM's count: 48 block ids, each a page in each layer of one of the two groups;
    # one request of 96 tokens needs 44, the workload far more at once.
    "preemption": {"num_gpu_blocks_override": 48},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Gemma 2 with four layers alternating sliding (window 8) and global attention:
    two KV cache groups of two layers."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma2"),
                                **CASES["gemma2-four-alternating"])


def record_held_blocks(llm: LLM) -> list[list[int]]:
    """Per scheduled step and running request, the real blocks it holds in each group
    (filled as the engine runs). Before each step it asserts that every running
    request, its rejected drafts rolled back, still holds in each sliding-window
    group the blocks its next query reads (keys after `num_computed_tokens - window`)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    kvm = sched.kv_cache_manager
    held: list[list[int]] = []
    schedule = sched.schedule

    def recording():
        for r in sched.running:
            c = r.num_computed_tokens
            for table, window in zip(kvm.tables, kvm.windows, strict=True):
                blocks = table[r.request_id][max(c - (window or c) + 1, 0) // kvm.block_size:
                                             -(-c // kvm.block_size)]
                assert not any(b.is_null for b in blocks), (r.request_id, c, window)
        out = schedule()
        held.extend(sched.kv_cache_manager.num_held_blocks(r.request_id)
                    for r in sched.running)
        return out

    sched.schedule = recording
    return held


def assert_windows_let_go(llm: LLM, held: list[list[int]]) -> None:
    """The sliding-window group really dropped blocks (8 blocks fewer than the global
    group of the same request at some step), and every block came back at the end."""
    kvm = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    assert kvm.windows == (None, 8)
    assert max(full - local for full, local in held) >= 8, max(held)
    assert kvm.usage == 0.0


@pytest.mark.slow  # engines with and without speculation
@pytest.mark.parametrize("method, extra_id", [
    ("ngram", "plain"), ("ngram", "whole-prompts"), ("ngram", "preemption"),
    ("self", "plain"), ("other", "plain"), ("noisy", "whole-prompts"),
    ("self", "preemption"), ("noisy", "preemption"),
])
def test_greedy_output_equals_no_speculation(model_dir, drafts, prompts, method, extra_id):
    extra = SETTINGS[extra_id]
    greedy, want, mixed, want_mixed = _reference(model_dir, prompts, extra_id, extra,
                                                 base=ENGINE)
    spec = SPEC if method == "ngram" else spec_config(drafts[method])
    llm = LLM(model_dir, **{**ENGINE, **extra}, speculative_config=spec)
    stats = _record_spec_stats(llm)
    held = record_held_blocks(llm)
    _assert_same(_run(llm, prompts, greedy), want)
    num_drafts, draft_tokens, accepted = _totals(stats)
    assert num_drafts > 0
    if method == "self":  # the target drafting for itself: every greedy draft is its choice
        assert accepted == draft_tokens
    elif method in ("ngram", "noisy"):  # some drafts rolled back
        assert 0 < accepted < draft_tokens
    _assert_same(_run(llm, prompts, mixed), want_mixed)
    if extra_id == "preemption":
        assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    assert_windows_let_go(llm, held)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "self"])
def test_prefix_cache_hits_keep_greedy_output(model_dir, drafts, prompts, method):
    """Every prompt again, its blocks now cached in both groups; the target drafting
    for itself still accepts every draft, so the draft's KV in the hit blocks (the
    full-attention group's) is its own."""
    # Eight requests at once: the first run's blocks are still cached when the second starts.
    engine = {**ENGINE, **ngram_tests.WHOLE}
    greedy, want, _, _ = _reference(model_dir, prompts, "whole-prompts", {}, base=engine)
    spec = SPEC if method == "ngram" else spec_config(drafts[method])
    llm = LLM(model_dir, **engine, speculative_config=spec)
    held = record_held_blocks(llm)
    draft_tokens, accepted = rerun_with_prefix_hits(llm, prompts, greedy, want)
    assert accepted > 0
    if method == "self":
        assert accepted == draft_tokens
    assert_windows_let_go(llm, held)


def test_dropping_blocks_as_if_every_draft_were_accepted_is_caught(model_dir, drafts, prompts,
                                                                  monkeypatch):
    """The planted bug: the sliding-window group lets go of blocks by the step's end
    (every draft accepted) instead of its start. After a rollback the next query
    reads a block already returned to the pool, and `record_held_blocks` says so
    (the random Llama's drafts are nearly all rejected)."""
    real = KVCacheManager._extend

    def optimistic(self, request, req_blocks, num_total):
        saved = request.num_computed_tokens
        request.num_computed_tokens = max(saved, num_total - 1)
        try:
            self._drop_out_of_window(request)
        finally:
            request.num_computed_tokens = saved
        return real(self, request, req_blocks, num_total)

    monkeypatch.setattr(KVCacheManager, "_extend", optimistic)
    llm = LLM(model_dir, **ENGINE, speculative_config=spec_config(drafts["other"]))
    record_held_blocks(llm)
    with pytest.raises(AssertionError, match=r"8\)"):  # (request id, computed, window 8)
        _run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))


@pytest.mark.slow
def test_no_compilation_after_warmup_with_a_hybrid_target_and_draft():
    """In a process of its own, as the ngram test (test_spec_decode.py) says why."""
    run_in_own_process(f"{__file__}::test_no_compilation_after_warmup_"
                       "with_a_hybrid_target_and_draft_in_this_process")


@isolated
def test_no_compilation_after_warmup_with_a_hybrid_target_and_draft_in_this_process(
        model_dir, drafts, prompts):
    """The draft's proposals (one table) and its mirror of the target's steps (every
    group's tables) are compiled at start-up for every bucket."""
    llm = LLM(model_dir, **{**ENGINE, "precompile": True},
              speculative_config=spec_config(drafts["noisy"]))
    assert_no_compilation_while_speculating(llm, prompts)


def test_a_draft_model_needs_a_target_with_a_full_attention_group():
    """A target whose layers all attend in windows (of two sizes) has no table that
    keeps the context; a draft model for it is refused, naming the field."""
    config = SimpleNamespace(draft_model_config=object())
    with pytest.raises(ParameterError) as err:
        DraftModel.load(config, None, None, None, None, KVCacheGroups.from_windows((8, 16)))
    assert err.value.field == "speculative_config.method"
