"""The logit controls of SamplingParams take effect end to end, through `LLM.generate`.

allowed_token_ids, logit_bias, bad_words (as strings and as token ids) and
min_tokens each change what a run produces; every test compares with the same
request without the knob, so a knob that is silently ignored fails the test.
One small engine serves the whole module.
"""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from tests.engine.hf_reference import random_prompts
from tests.models.tiny_checkpoints import EOS_ID, checkpoint_vocab_size

SETTINGS = dict(dtype="float32", max_model_len=64, max_num_seqs=4, block_size=8, seed=0,
                token_buckets=[16, 32], request_buckets=[4], max_num_batched_tokens=32)
MAX_TOKENS = 24


pytestmark = pytest.mark.slow  # an engine for the module


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, **SETTINGS)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return random_prompts(checkpoint_vocab_size(model_dir), [7, 12, 5], seed=11)


def _generate(llm: LLM, prompts, params: SamplingParams):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_allowed_token_ids_confine_seeded_sampling_to_the_set(llm, prompts):
    allowed = [40, 41, 42, 43, 44]
    kw = dict(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    free = _generate(llm, prompts, SamplingParams(**kw))
    confined = _generate(llm, prompts, SamplingParams(**kw, allowed_token_ids=allowed))
    # Unconstrained sampling strays outside the set, so the check below has teeth.
    assert any(set(c.token_ids) - set(allowed) for c in free)
    for c in confined:
        assert len(c.token_ids) == MAX_TOKENS and set(c.token_ids) <= set(allowed)
    # More than one allowed token is drawn: the mask does not collapse sampling to greedy.
    assert len({t for c in confined for t in c.token_ids}) > 1


def test_a_large_positive_logit_bias_makes_greedy_pick_that_token(llm, prompts):
    base = _generate(llm, prompts, _greedy())
    target = next(t for t in range(100, 200) if all(t not in c.token_ids for c in base))
    biased = _generate(llm, prompts, _greedy(logit_bias={target: 100.0}))
    assert all(c.token_ids == [target] * MAX_TOKENS for c in biased)


def test_a_minus_100_logit_bias_removes_the_greedy_token_for_the_runner_up(llm, prompts):
    base = _generate(llm, prompts, _greedy(logprobs=2))
    for prompt, ref in zip(prompts, base, strict=True):
        first = ref.token_ids[0]
        runner_up = next(t for t, lp in ref.logprobs[0].items() if lp.rank == 2)
        (out,) = _generate(llm, [prompt], _greedy(logit_bias={first: -100.0}))
        assert out.token_ids[0] == runner_up != first
        assert first not in out.token_ids


def test_bad_words_token_ids_ban_a_single_token_and_the_last_token_of_a_sequence(
        llm, prompts):
    base = _generate(llm, prompts, _greedy())
    for prompt, ref in zip(prompts, base, strict=True):
        g0, g1 = ref.token_ids[:2]
        (single,) = _generate(llm, [prompt], _greedy(bad_words_token_ids=[[g0]]))
        assert g0 not in single.token_ids
        # A two-token word only bans its last token right after its first.
        (pair,) = _generate(llm, [prompt], _greedy(bad_words_token_ids=[[g0, g1]]))
        assert pair.token_ids[0] == g0 and pair.token_ids[1] != g1
        assert all(pair.token_ids[i + 1] != g1 for i in range(MAX_TOKENS - 1)
                   if pair.token_ids[i] == g0)


def test_bad_words_strings_become_token_ids_with_and_without_a_leading_space(llm):
    tok = llm.get_tokenizer()
    a, b, space = (tok.convert_tokens_to_ids(c) for c in "ab ")
    convert = llm.llm_engine.input_processor._bad_words_ids
    assert convert(["ab"]) == [[a, b], [space, a, b]]
    assert convert([" ab", "a"]) == [[a, b], [space, a, b], [a], [space, a]]


def test_bad_words_strings_change_generation_where_the_word_would_appear(llm, prompts):
    tok = llm.get_tokenizer()
    letters = [tok.convert_tokens_to_ids(c) for c in "abcde"]
    base = _generate(llm, prompts, _greedy(allowed_token_ids=letters))
    for prompt, ref in zip(prompts, base, strict=True):
        first, second = tok.convert_ids_to_tokens(ref.token_ids[:2])
        (single,) = _generate(llm, [prompt],
                              _greedy(allowed_token_ids=letters, bad_words=[first]))
        assert first not in tok.convert_ids_to_tokens(single.token_ids)
        (pair,) = _generate(llm, [prompt], _greedy(allowed_token_ids=letters,
                                                    bad_words=[first + second]))
        assert first + second not in pair.text and pair.text.startswith(first)


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_min_tokens_holds_back_a_stop_token_until_enough_tokens(llm, prompts, stop):
    # A large bias makes the stop token the greedy choice at every step.
    token = EOS_ID if stop == "eos" else 77
    kw = dict(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={token: 100.0},
              stop_token_ids=[] if stop == "eos" else [token])
    eager = _generate(llm, prompts, SamplingParams(**kw))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in eager)
    held = _generate(llm, prompts, SamplingParams(**kw, min_tokens=6))
    for c in held:
        assert token not in c.token_ids[:6]
        assert len(c.token_ids) == 7 and c.token_ids[6] == token
        assert c.finish_reason == "stop"


@pytest.mark.parametrize("staged_by", [dict(logprobs=1), dict(logit_bias={0: 0.0})],
                         ids=["logprobs", "zero-logit-bias"])
def test_the_one_program_sampler_draws_what_the_staged_sampler_draws(llm, prompts, staged_by):
    # A plain step runs logits + draw as one program; a step with logprobs or a
    # logit adjustment goes through the staged sampler (logits, then adjust and
    # draw). Neither knob here changes the distribution: same keys, same tokens.
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
              ignore_eos=True)
    plain = _generate(llm, prompts, SamplingParams(**kw))
    staged = _generate(llm, prompts, SamplingParams(**kw, **staged_by))
    assert [o.token_ids for o in staged] == [o.token_ids for o in plain]
    # Sampled, not greedy: the seeded draw differs from the arg-max somewhere.
    assert [o.token_ids for o in plain] != [o.token_ids for o in _generate(llm, prompts,
                                                                         _greedy())]
