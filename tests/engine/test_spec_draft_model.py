"""Speculative decoding with a draft model through the engine: the oracle is the same
engine without speculation.

Three drafts of the tiny target: the target itself (greedy drafts are then all
accepted), a noisy copy of it (some accepted, some not) and an unrelated random
model of another depth (nearly all rejected). Greedy output must equal no
speculation's under chunked prefill, prefix caching and preemption; at
temperature 1 the verified tokens' distributions must equal it too; the
draft's programs are compiled at start-up; and the server takes the method in
`--speculative-config`.
"""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from tests.engine.test_spec_decode import (
    BASE,
    WHOLE,
    _assert_same,
    _record_spec_stats,
    _run,
    _totals,
    assert_no_compilation_while_speculating,
    assert_same_token_distribution,
)
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.own_process import isolated, run_in_own_process

pytestmark = pytest.mark.slow  # engines with and without speculation


def noisy_copy(model_dir: str, out_dir, std: float, seed: int = 0) -> str:
    """`model_dir`'s weights plus Gaussian noise of `std`, saved as a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(out_dir))
    return str(out_dir)


def spec_config(draft: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def drafts(model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    return {"self": model_dir,
            "noisy": noisy_copy(model_dir, root / "noisy", std=0.04),
            "other": make_tiny_checkpoint(root, arch="llama", seed=7, num_hidden_layers=1,
                                          num_key_value_heads=1)}


@pytest.fixture(scope="module")
def prompts(model_dir):
    from tests.engine.hf_reference import random_prompts
    from tests.models.tiny_checkpoints import checkpoint_vocab_size

    rand = random_prompts(checkpoint_vocab_size(model_dir), [7, 12, 30, 19, 5, 26], seed=3)
    return [rand[0] * 2, rand[1], rand[1] + rand[4], rand[2], rand[3], rand[5]]


_REFERENCE: dict[tuple[str, str], tuple] = {}


def _reference(model_dir, prompts, extra_id, extra, base=BASE, max_tokens=32,
               stops=(9, 17, 5, 30, 22, 13)):
    """No speculation's outputs for greedy requests and for requests that stop early
    (stop tokens at output positions `stops` inside an accepted run, max_tokens,
    logprobs), once per model and setting (`base` updated with `extra`, named
    `extra_id`)."""
    key = (model_dir, extra_id, max_tokens)
    if key not in _REFERENCE:
        ref = LLM(model_dir, **{**base, **extra})
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        want = _run(ref, prompts, greedy)
        mixed = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                stop_token_ids=[toks[0][0][k]])
                 for toks, k in zip(want, stops, strict=True)]
        mixed[3] = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=2)
        _REFERENCE[key] = (greedy, want, mixed, _run(ref, prompts, mixed))
    return _REFERENCE[key]


def run_twice_with_prefix_hits(llm, prompts, greedy, want, record):
    """The prompts twice, the second time hitting the prefix cache, each run equal to
    `want`; what `record(llm)`, installed between the runs, recorded of the second."""
    _assert_same(_run(llm, prompts, greedy), want)
    kvm = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    hits = kvm.prefix_cache_stats.hits
    recorded = record(llm)
    _assert_same(_run(llm, prompts, greedy), want)
    assert kvm.prefix_cache_stats.hits > hits
    return recorded


def rerun_with_prefix_hits(llm, prompts, greedy, want) -> tuple[int, int]:
    """`run_twice_with_prefix_hits`'s second run's (draft tokens, accepted tokens)."""
    stats = run_twice_with_prefix_hits(llm, prompts, greedy, want, _record_spec_stats)
    _, draft_tokens, accepted = _totals(stats)
    return draft_tokens, accepted


@pytest.mark.parametrize("draft, extra_id, extra", [
    ("self", "plain", {}),
    ("noisy", "plain", {}),
    ("other", "plain", {}),
    ("noisy", "whole-prompts", WHOLE),
    # Eight requests at once over 20 blocks.
    ("self", "preemption", {**WHOLE, "num_kv_blocks": 20}),
    ("noisy", "preemption", {**WHOLE, "num_kv_blocks": 20}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_greedy_output_equals_no_speculation(model_dir, drafts, prompts, draft, extra_id,
                                             extra):
    greedy, want, mixed, want_mixed = _reference(model_dir, prompts, extra_id, extra)
    llm = LLM(model_dir, **{**BASE, **extra}, speculative_config=spec_config(drafts[draft]))
    stats = _record_spec_stats(llm)
    _assert_same(_run(llm, prompts, greedy), want)
    num_drafts, draft_tokens, accepted = _totals(stats)
    assert num_drafts > 0
    if draft == "self":  # the target drafting for itself: every greedy draft is its choice
        assert accepted == draft_tokens
    elif draft == "noisy":
        assert 0 < accepted < draft_tokens
    _assert_same(_run(llm, prompts, mixed), want_mixed)
    core = llm.llm_engine.engine_core.engine_core
    if "num_kv_blocks" in extra:
        assert core.scheduler.num_preemptions > 0
    assert core.scheduler.kv_cache_manager.usage == 0.0  # every block came back


def test_prefix_cache_hits_keep_greedy_output_and_the_drafts_kv(model_dir, drafts, prompts):
    """A prompt whose blocks are cached skips the draft's forward over them too: its
    drafts read the draft KV the earlier request wrote into those same blocks (the
    target drafting for itself accepts every draft only if that KV is right)."""
    greedy, want, _, _ = _reference(model_dir, prompts, "plain", {})
    llm = LLM(model_dir, **BASE, speculative_config=spec_config(drafts["self"]))
    draft_tokens, accepted = rerun_with_prefix_hits(llm, prompts, greedy, want)
    assert accepted == draft_tokens > 0


def test_temperature_one_distribution_equals_no_speculation(tmp_path):
    """The second and third tokens (the two drafts of the first verify step) over many
    seeds, a two-sample chi-square test against the engine without speculation. A
    small model (vocabulary 64) and a slightly noisy copy of it as the draft: its
    greedy drafts are accepted about a third of the time, so both the accepted
    drafts and the residual draws after a rejection shape the counts."""
    model_dir = make_tiny_checkpoint(tmp_path, init_std=0.5, vocab_size=64)
    draft = noisy_copy(model_dir, tmp_path / "draft", std=0.02)
    prompt = list(range(8, 24))
    n = 1000
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True)
              for s in range(n)]
    kw = dict(BASE, max_num_seqs=32, request_buckets=[32], token_buckets=[32, 64],
              max_num_batched_tokens=64, max_model_len=40)
    num_drafts, draft_tokens, accepted = assert_same_token_distribution(
        model_dir, kw, spec_config(draft, k=2), prompt, params, vocab_size=64)
    assert num_drafts >= n and draft_tokens // 10 < accepted < draft_tokens // 2, (
        num_drafts, draft_tokens, accepted)


def test_no_compilation_after_warmup_with_a_draft_model():
    """In a process of its own, as the ngram test (test_spec_decode.py) says why."""
    run_in_own_process(
        f"{__file__}::test_no_compilation_after_warmup_with_a_draft_model_in_this_process")


@isolated
def test_no_compilation_after_warmup_with_a_draft_model_in_this_process(model_dir, drafts,
                                                                         prompts):
    llm = LLM(model_dir, **BASE, speculative_config=spec_config(drafts["noisy"]),
              precompile=True)
    assert_no_compilation_while_speculating(llm, prompts)
