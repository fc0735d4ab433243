"""SamplingParams and the InputProcessor refuse every value the engine core cannot hold,
with a ParameterError (a ValueError) that names the field, before anything is queued."""

from __future__ import annotations

import types

import pytest

from jaxllm import SamplingParams
from jaxllm.engine.input_processor import InputProcessor, fan_out
from jaxllm.errors import ParameterError
from jaxllm.sampling_params import DEFAULT_MAX_N_SEQUENCES, SEED_LIMIT

HUGE = [2**63, 2**64 - 1, 2**70]


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("field", ["max_tokens", "min_tokens", "n", "seed", "top_k",
                                   "logprobs", "prompt_logprobs"])
def test_integers_past_the_engines_range_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be at most"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
@pytest.mark.parametrize("value", [*HUGE, -1])
def test_token_ids_outside_int32_name_their_field(field, value):
    with pytest.raises(ParameterError, match=f"^{field}: must be at "):
        SamplingParams(**{field: [value]})


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e300])
def test_non_finite_floats_name_their_field(field, value):
    with pytest.raises(ParameterError, match=f"^{field}: "):
        SamplingParams(**{field: value})


def test_a_non_finite_logit_bias_is_refused():
    with pytest.raises(ParameterError, match="^logit_bias: "):
        SamplingParams(logit_bias={5: float("nan")})


@pytest.mark.parametrize("field,value", [("stop", ["ok", "a\ud800"]), ("stop", "\udfff"),
                                         ("bad_words", ["\ud800"])])
def test_strings_that_are_not_valid_unicode_are_refused(field, value):
    with pytest.raises(ParameterError, match=f"^{field}: is not valid Unicode"):
        SamplingParams(**{field: value})


def test_n_is_bounded_as_vllm_bounds_it_and_the_bound_is_configurable(monkeypatch):
    monkeypatch.delenv("JAXLLM_MAX_N_SEQUENCES", raising=False)
    assert SamplingParams(n=DEFAULT_MAX_N_SEQUENCES).n == 16384
    with pytest.raises(ParameterError, match="^n: must be at most 16384"):
        SamplingParams(n=DEFAULT_MAX_N_SEQUENCES + 1)
    monkeypatch.setenv("JAXLLM_MAX_N_SEQUENCES", "4")
    with pytest.raises(ParameterError, match="^n: must be at most 4"):
        SamplingParams(n=5)


def test_the_children_of_a_seeded_request_keep_valid_seeds():
    children = fan_out(SamplingParams(n=3, seed=SEED_LIMIT - 2))
    assert [c.seed for c in children] == [SEED_LIMIT - 2, SEED_LIMIT - 1, 0]
    for child in children:
        child.verify()


MAX_MODEL_LEN = 32


@pytest.fixture
def processor() -> InputProcessor:
    model_config = types.SimpleNamespace(max_model_len=MAX_MODEL_LEN, vocab_size=100,
                                         eos_token_ids=[2])
    return InputProcessor(model_config, tokenizer=None)


PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def test_min_tokens_is_checked_against_the_derived_max_tokens(processor):
    room = MAX_MODEL_LEN - 4
    req, _ = processor.process("ok", PROMPT, SamplingParams(max_tokens=None, min_tokens=room))
    assert req.sampling_params.max_tokens == room
    with pytest.raises(ParameterError, match=f"^min_tokens: must be at most max_tokens={room}"):
        processor.process("r", PROMPT, SamplingParams(max_tokens=None, min_tokens=room + 1))


def test_a_max_tokens_past_the_context_is_capped_to_the_room_left(processor):
    params = SamplingParams(max_tokens=2**62, min_tokens=2**61)
    req, _ = processor.process("r", PROMPT, params)
    room = MAX_MODEL_LEN - 4
    assert (req.sampling_params.max_tokens, req.sampling_params.min_tokens) == (room, room)
    assert params.max_tokens == 2**62  # the caller's object is left alone


@pytest.mark.parametrize("prompt,field", [
    ("a\ud800", "prompt"),
    ({"prompt": "\udfff", "prompt_token_ids": [5]}, "prompt"),
    ({"prompt_token_ids": [5, 2**70]}, "prompt_token_ids"),
    ({"prompt_token_ids": ["x"]}, "prompt_token_ids"),
])
def test_bad_prompts_name_their_field(processor, prompt, field):
    with pytest.raises(ParameterError, match=f"^{field}: "):
        processor.process("r", prompt, SamplingParams())


def test_a_priority_outside_int64_is_refused(processor):
    with pytest.raises(ParameterError, match="^priority: "):
        processor.process("r", PROMPT, SamplingParams(), priority=2**63)


def test_a_priority_needs_the_priority_policy(processor):
    with pytest.raises(ParameterError, match="^priority: needs scheduling_policy='priority'"):
        processor.requests("r", PROMPT, SamplingParams(), priority=1)
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(policy="priority"),
                                   lora_config=None)
    prioritized = InputProcessor(processor.model_config, None, config=config)
    [req], _, _ = prioritized.requests("r", PROMPT, SamplingParams(), priority=-3)
    assert req.priority == -3


def test_an_adapter_needs_lora_enabled(processor):
    from jaxllm.lora.request import LoRARequest

    with pytest.raises(ParameterError, match="^lora_request: LoRA is not enabled"):
        processor.requests("r", PROMPT, SamplingParams(), lora_request=LoRARequest("a", 1, "/x"))


def test_a_request_of_n_samples_becomes_n_children_of_one_each(processor):
    [one], _, _ = processor.requests("r", PROMPT, SamplingParams(seed=7))
    assert (one.request_id, one.sampling_params.n) == ("r", 1)
    children, _, kind = processor.requests("r", PROMPT, SamplingParams(n=3, seed=7))
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [(c.sampling_params.n, c.sampling_params.seed) for c in children] == [
        (1, 7), (1, 8), (1, 9)]
    assert kind == SamplingParams().output_kind
