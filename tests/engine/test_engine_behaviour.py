"""Scheduling choices never change greedy outputs; the engine survives bad input."""

from __future__ import annotations

import json

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.errors import ParameterError
from tests.compilations import recorded_compilations
from tests.engine.hf_reference import random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size

BASE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, block_size=8, seed=0,
            token_buckets=[16, 64], request_buckets=[4, 8], max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(model_dir):
    vocab = checkpoint_vocab_size(model_dir)
    # Two prompts share a long prefix so that prefix caching has something to find.
    base = random_prompts(vocab, [9, 17, 30, 41, 6, 23], seed=3)
    base.append(base[3][:33] + base[0][:5])
    return base


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    llm = LLM(model_dir, **BASE, enable_prefix_caching=False)
    return _tokens(llm, prompts)


def _tokens(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_greedy_tokens(model_dir, prompts, reference):
    llm = LLM(model_dir, **{**BASE, "max_num_batched_tokens": 16, "token_buckets": [16]},
              enable_prefix_caching=False)
    assert _tokens(llm, prompts) == reference


@pytest.mark.slow
def test_prefix_cache_hits_on_rerun_and_outputs_do_not_change(model_dir, prompts, reference):
    llm = LLM(model_dir, **BASE, enable_prefix_caching=True)
    assert _tokens(llm, prompts) == reference
    stats = llm.llm_engine.last_stats
    hits_first = stats.prefix_cache_hits
    assert _tokens(llm, prompts) == reference
    stats = llm.llm_engine.last_stats
    assert stats.prefix_cache_hits > hits_first
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits


@pytest.mark.slow
def test_preemption_happens_under_a_small_kv_budget_and_outputs_do_not_change(
        model_dir, prompts, reference):
    # 14 blocks of 8 tokens: too few for 7 requests of up to 65 tokens at once.
    llm = LLM(model_dir, **BASE, enable_prefix_caching=True, num_kv_blocks=14)
    assert _tokens(llm, prompts) == reference
    assert llm.llm_engine.last_stats.num_preemptions > 0


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.slow
def test_a_preempted_request_reports_each_prompt_logprob_once(model_dir, chunked):
    """The two requests that ask for prompt logprobs arrive last, so they are the ones
    preempted (and recomputed from their first token when resumed); their prompt
    logprobs must be those of a run without preemption, one per prompt position."""
    vocab = checkpoint_vocab_size(model_dir)
    prompts = random_prompts(vocab, [30, 30, 6, 21], seed=5)
    plain = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, prompt_logprobs=1)
    extra = {"max_num_batched_tokens": 16, "token_buckets": [16]} if chunked else {}

    def run(**kw):
        llm = LLM(model_dir, **{**BASE, **extra, **kw}, enable_prefix_caching=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [plain, plain, scored, scored], use_tqdm=False)
        lps = [[d and {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs or []]
               for o in outs]
        return llm.llm_engine.last_stats.num_preemptions, lps

    none, want = run()
    # 20 blocks of 8 tokens: the four requests grow to 90 tokens each.
    preemptions, got = run(num_kv_blocks=20)
    assert none == 0 and preemptions > 0
    assert [len(x) for x in got] == [0, 0, 6, 21]
    for g, w in zip(got, want, strict=True):
        assert [d and sorted(d) for d in g] == [d and sorted(d) for d in w]
        assert [v for d in g[1:] for v in d.values()] == pytest.approx(
            [v for d in w[1:] for v in d.values()], abs=1e-5)


@pytest.mark.slow
def test_24_prompts_batched_across_request_buckets_and_chunks_equal_each_run_alone(model_dir):
    """24 prompts of 1 to 60 tokens with 3 to 20 new tokens each: together they cross
    both request buckets (24 running, then fewer as short ones finish) and their 614
    prompt tokens are cut into 64-token chunks beside decodes; alone, each runs at
    batch 1 with its prompt in one step. Greedy tokens must agree exactly."""
    vocab = checkpoint_vocab_size(model_dir)
    lengths = [1, 60, 7, 33, 2, 48, 15, 26, 9, 57, 4, 40,
               21, 12, 52, 3, 29, 18, 44, 6, 37, 11, 55, 24]
    prompts = random_prompts(vocab, lengths, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + (7 * i) % 18, ignore_eos=True)
              for i in range(len(prompts))]

    alone = LLM(model_dir, **{**BASE, "max_num_seqs": 1, "request_buckets": [1]},
                enable_prefix_caching=False)
    expected = [_tokens(alone, [p], q)[0] for p, q in zip(prompts, params, strict=True)]

    batched = LLM(model_dir, **{**BASE, "max_num_seqs": 24, "request_buckets": [8, 24]},
                  enable_prefix_caching=False)
    runner = batched.llm_engine.engine_core.engine_core.model_runner
    runner.step_log = []
    outs = batched.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
    steps = runner.step_log
    # The batch really spanned both request buckets and was chunked by the budget.
    assert max(s.num_reqs for s in steps) > 8 and min(s.num_reqs for s in steps) <= 8
    assert sum(lengths) > 64 and max(s.num_tokens for s in steps) == 64
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.slow
def test_no_compilation_after_warmup_during_a_mixed_workload(model_dir, prompts):
    llm = LLM(model_dir, **BASE, precompile=True)
    with recorded_compilations() as compiles:
        mixed = [
            GREEDY,
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, seed=1),
            SamplingParams(temperature=1.0, min_p=0.1, max_tokens=7, logprobs=3),
            SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.2, max_tokens=9),
            SamplingParams(temperature=0.0, logit_bias={20: 5.0}, max_tokens=5, min_tokens=3,
                           bad_words_token_ids=[[7], [5, 9]]),
            SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
            SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=5),
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], mixed, use_tqdm=False)
        # Greedy only: nothing reads its output history, so every step after
        # the first runs ahead and takes in-flight tokens from the device, in
        # both token buckets (prefill chunks beside decodes, then decodes).
        runner = llm.llm_engine.engine_core.engine_core.model_runner
        runner.step_log = []
        _tokens(llm, prompts + prompts)
        buckets_used = {s.padded_tokens for s in runner.step_log}
    assert all(o.finished for o in outs)
    assert buckets_used == {16, 64}
    assert compiles == []


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model_dir, prompts):
    llm = LLM(model_dir, **BASE)
    seeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _tokens(llm, [prompts[0]], seeded)[0]
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = [prompts[1], prompts[2], prompts[0], prompts[3]]
    mixed = llm.generate([{"prompt_token_ids": p} for p in batch],
                         [other, other, seeded, other], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    # Same prompt, same seed, different neighbours and row: same tokens.
    again = llm.generate([{"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[0]}],
                         [other, seeded], use_tqdm=False)
    assert again[1].outputs[0].token_ids == alone
    # Unseeded requests on the same prompt draw different samples.
    unseeded = _tokens(llm, [prompts[0]] * 2, other)
    assert unseeded[0] != unseeded[1]


@pytest.mark.parametrize("bad, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(temperature=-0.1), "temperature"),
])
def test_bad_sampling_params_name_the_field(bad, field):
    with pytest.raises(ParameterError) as e:
        SamplingParams(**bad)
    assert e.value.field == field and field in str(e.value)


@pytest.mark.slow
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(model_dir, prompts, reference):
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **BASE))
    engine.add_request("good-0", {"prompt_token_ids": prompts[0]}, GREEDY)
    with pytest.raises(ParameterError) as e:
        engine.add_request("too-long", {"prompt_token_ids": [10] * 200}, GREEDY)
    assert e.value.field == "prompt" and "max_model_len" in str(e.value)
    with pytest.raises(ParameterError) as e:
        engine.add_request("bad-id", {"prompt_token_ids": [10, 10**6]}, GREEDY)
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(ParameterError):
        engine.add_request("good-0", {"prompt_token_ids": prompts[1]}, GREEDY)  # duplicate id
    engine.add_request("good-1", {"prompt_token_ids": prompts[1]}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"good-0": reference[0], "good-1": reference[1]}


def test_unknown_model_directory_and_malformed_config_name_the_problem(tmp_path, model_dir):
    with pytest.raises(ParameterError) as e:
        LLM(str(tmp_path / "nope"))
    assert e.value.field == "model"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ParameterError) as e:
        LLM(str(broken))
    assert "config.json" in str(e.value)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ParameterError) as e:
        LLM(str(partial))
    assert e.value.field.startswith("config.json:")


def test_max_model_len_past_the_trained_positions_and_no_data_parallel_replica_are_refused(
        model_dir, monkeypatch):
    with pytest.raises(ParameterError) as e:
        LLM(model_dir, max_model_len=257)  # the tiny checkpoint has 256 positions
    assert e.value.field == "max_model_len" and "256" in str(e.value)
    with pytest.raises(ParameterError) as e:
        LLM(model_dir, data_parallel_size=0)
    assert e.value.field == "data_parallel_size"
    monkeypatch.setenv("JAXLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    config = EngineArgs(model=model_dir, max_model_len=257).create_engine_config()
    assert config.model_config.max_model_len == 257


def test_unknown_engine_argument_is_a_type_error(model_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(model_dir, max_num_seq=4)


def test_embed_returns_the_normalized_last_hidden_state(model_dir, prompts):
    import numpy as np
    import torch
    from transformers import AutoModel

    llm = LLM(model_dir, **BASE)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts[:3]], use_tqdm=False)
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    for out, p in zip(outs, prompts[:3], strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0, -1].numpy()
        ref = ref / np.linalg.norm(ref)
        assert np.abs(np.array(out.outputs.embedding) - ref).max() < 1e-4


def test_n_samples_stop_strings_logprobs_and_prompt_logprobs(model_dir, prompts):
    llm = LLM(model_dir, **BASE)
    (out,) = llm.generate({"prompt_token_ids": prompts[0]},
                          SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                         logprobs=2, prompt_logprobs=1, ignore_eos=True),
                          use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == 5 and len(c.logprobs) == 5
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert tok in lp and len(lp) <= 3
        assert c.cumulative_logprob == sum(lp[t].logprob for t, lp in zip(
            c.token_ids, c.logprobs, strict=True))
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompts[0])
    for tok, lp in zip(prompts[0][1:], out.prompt_logprobs[1:], strict=True):
        assert tok in lp
    # Stop strings are found in detokenized text and cut it.
    text = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)[0]
    full = text.outputs[0].text
    stop = full[5:7]
    cut = llm.generate({"prompt_token_ids": prompts[1]},
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]


def test_token_ids_in_and_out_without_a_tokenizer(model_dir, prompts, reference):
    llm = LLM(model_dir, **BASE, skip_tokenizer_init=True)
    out = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[0] and out.outputs[0].text == ""
    with pytest.raises(ParameterError):
        llm.generate("text needs a tokenizer", GREEDY, use_tqdm=False)


def test_tensor_parallel_2_gives_the_tp1_greedy_tokens(model_dir, prompts, reference):
    llm = LLM(model_dir, **BASE, enable_prefix_caching=False, tensor_parallel_size=2)
    assert _tokens(llm, prompts) == reference


def test_chat_applies_the_template(model_dir):
    llm = LLM(model_dir, **BASE)
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "abc"}]
    out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out.prompt == want
    assert out.prompt_token_ids == tok(want, add_special_tokens=False).input_ids
