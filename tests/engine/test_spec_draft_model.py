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

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tests.compilations import recorded_compilations
from tests.engine.test_spec_decode import BASE, _assert_same, _record_spec_stats, _run, _totals
from tests.models.tiny_checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # engines with and without speculation
ISOLATED = "JAXLLM_TEST_ISOLATED"


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


_REFERENCE: dict[str, tuple] = {}


def _reference(model_dir, prompts, extra_id, extra):
    """No speculation's outputs for greedy requests and for requests that stop early
    (stop tokens and max_tokens inside an accepted run, logprobs), once per setting."""
    if extra_id not in _REFERENCE:
        ref = LLM(model_dir, **{**BASE, **extra})
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        want = _run(ref, prompts, greedy)
        mixed = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                stop_token_ids=[toks[0][0][k]])
                 for toks, k in zip(want, [9, 17, 5, 30, 22, 13], strict=True)]
        mixed[3] = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=2)
        _REFERENCE[extra_id] = (greedy, want, mixed, _run(ref, prompts, mixed))
    return _REFERENCE[extra_id]


@pytest.mark.parametrize("draft, extra_id, extra", [
    ("self", "plain", {}),
    ("noisy", "plain", {}),
    ("other", "plain", {}),
    ("noisy", "chunked-prefill", {"max_num_batched_tokens": 16, "token_buckets": [16]}),
    ("self", "preemption", {"num_kv_blocks": 20}),
    ("noisy", "preemption", {"num_kv_blocks": 20}),
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
    first = _run(llm, prompts, greedy)
    kvm = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    hits = kvm.prefix_cache_stats.hits
    stats = _record_spec_stats(llm)
    again = _run(llm, prompts, greedy)
    assert kvm.prefix_cache_stats.hits > hits
    _assert_same(first, want)
    _assert_same(again, want)
    _, draft_tokens, accepted = _totals(stats)
    assert accepted == draft_tokens > 0


def test_temperature_one_distribution_equals_no_speculation(tmp_path):
    """The second and third tokens (the two drafts of the first verify step) over many
    seeds, a two-sample chi-square test against the engine without speculation. A
    small model (vocabulary 64) and a slightly noisy copy of it as the draft: its
    greedy drafts are accepted about a third of the time, so both the accepted
    drafts and the residual draws after a rejection shape the counts."""
    from tests.spec_decode.chi_square import chi2_threshold, homogeneity

    model_dir = make_tiny_checkpoint(tmp_path, init_std=0.5, vocab_size=64)
    draft = noisy_copy(model_dir, tmp_path / "draft", std=0.02)
    prompt = list(range(8, 24))
    n = 1000
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True)
              for s in range(n)]
    kw = dict(BASE, max_num_seqs=32, request_buckets=[32], token_buckets=[32, 64],
              max_num_batched_tokens=64, max_model_len=40)
    outs = {}
    for name, spec in (("plain", None), ("spec", spec_config(draft, k=2))):
        llm = LLM(model_dir, **kw, speculative_config=spec)
        stats = _record_spec_stats(llm)
        got = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        outs[name] = np.array([o.outputs[0].token_ids for o in got])
        if spec:
            num_drafts, draft_tokens, accepted = _totals(stats)
            assert num_drafts >= n and draft_tokens // 10 < accepted < draft_tokens // 2, (
                num_drafts, draft_tokens, accepted)
    for pos in (1, 2):
        a, b = (np.bincount(outs[k][:, pos], minlength=64) for k in ("plain", "spec"))
        stat, df = homogeneity(a, b)
        assert df >= 3 and stat < chi2_threshold(df), (pos, stat, df)


def test_no_compilation_after_warmup_with_a_draft_model():
    """In a process of its own, as the ngram test (test_spec_decode.py) says why."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::test_no_compilation_after_warmup_with_a_draft_model_in_this_process"],
        env={**os.environ, ISOLATED: "1"}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.skipif(os.environ.get(ISOLATED) != "1",
                    reason="runs in its own process (test_no_compilation_after_warmup_...)")
def test_no_compilation_after_warmup_with_a_draft_model_in_this_process(model_dir, drafts,
                                                                         prompts):
    llm = LLM(model_dir, **BASE, speculative_config=spec_config(drafts["noisy"]))
    stats = _record_spec_stats(llm)
    with recorded_compilations() as compiles:
        _run(llm, prompts, [
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=30, seed=1),
            SamplingParams(temperature=1.0, min_p=0.1, max_tokens=30, logprobs=3),
            SamplingParams(temperature=0.7, presence_penalty=0.5, max_tokens=9),
            SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=30, logit_bias={9: 1.0}),
        ])
    assert compiles == []
    assert _totals(stats)[0] > 0


def test_server_takes_a_draft_model_in_speculative_config(model_dir, drafts):
    """`--speculative-config` JSON with the draft_model method: greedy completions equal
    the offline engine's without speculation, and /metrics counts the drafts."""
    from openai import OpenAI

    from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer

    prompt = [5, 9, 40, 41, 42, 7, 5, 9, 40]
    want = LLM(model_dir, **BASE).generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    # BASE's shapes, so that the server's programs come from the compilation cache.
    srv = RemoteServer([model_dir, *TINY_ENGINE_FLAGS, "--max-model-len", "128",
                        "--max-num-seqs", "8", "--request-buckets", "4,8",
                        "--speculative-config", json.dumps(spec_config(drafts["self"]))])
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x")
        out = client.completions.create(model=model_dir, prompt=prompt, max_tokens=12,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == want and out.usage.completion_tokens == 12
        m = srv.metrics()
        assert m["vllm:spec_decode_num_drafts_total"] > 0
        assert (m["vllm:spec_decode_num_accepted_tokens_total"]
                == m["vllm:spec_decode_num_draft_tokens_total"] > 0)
    finally:
        srv.stop()
