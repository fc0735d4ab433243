"""Structured outputs through `LLM.generate` on a random-weight model.

Every output of a constrained request must satisfy its constraint (random
JSON schemas from hypothesis, random bounded regexes, choices); unconstrained
requests beside them generate what they generate alone; a malformed
constraint is a ParameterError naming its field; nothing compiles after
warm-up. One small engine serves the module.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ParameterError
from jaxllm.sampling_params import StructuredOutputsParams
from tests.compilations import recorded_compilations
from tests.engine.hf_reference import random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint
from tests.structured_output.schemas import json_schemas, validate

SETTINGS = dict(dtype="float32", max_model_len=512, max_num_seqs=4, block_size=8, seed=0,
                token_buckets=[16, 64], request_buckets=[4], max_num_batched_tokens=64)
MAX_TOKENS = 300
HYPOTHESIS = settings(max_examples=12, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.function_scoped_fixture,
                                             HealthCheck.too_slow])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                max_position_embeddings=512)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, **SETTINGS, precompile=True)  # warmed up: nothing compiles


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return random_prompts(checkpoint_vocab_size(model_dir), [7, 12, 5, 9], seed=3)


def _params(i: int, **structured) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd i: both paths of the sampler."""
    return SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(**structured))


def _run(llm: LLM, prompts, params: list[SamplingParams]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:len(params)]], params,
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


@HYPOTHESIS
@given(schemas=st.lists(json_schemas(), min_size=4, max_size=4))
def test_every_output_of_a_random_json_schema_parses_and_validates(llm, prompts, schemas):
    outs = _run(llm, prompts, [_params(i, json=s) for i, s in enumerate(schemas)])
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        validate(schema, json.loads(out.text))


_REGEXES = st.lists(st.sampled_from(["[a-z]", "[0-9]", "(ab|cd)", "x?", "[A-F]{2}", "-"]),
                    min_size=1, max_size=6).map("".join)


@HYPOTHESIS
@given(patterns=st.lists(_REGEXES, min_size=4, max_size=4))
def test_every_output_of_a_random_regex_matches_it_whole(llm, prompts, patterns):
    outs = _run(llm, prompts, [_params(i, regex=p) for i, p in enumerate(patterns)])
    for pattern, out in zip(patterns, outs, strict=True):
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), (pattern, out.text)


@HYPOTHESIS
@given(choices=st.lists(st.lists(st.text("ab \"\\{}", min_size=1, max_size=5), min_size=1,
                                 max_size=4, unique=True), min_size=4, max_size=4))
def test_every_output_of_a_choice_is_one_of_the_choices(llm, prompts, choices):
    outs = _run(llm, prompts, [_params(i, choice=c) for i, c in enumerate(choices)])
    for choice, out in zip(choices, outs, strict=True):
        assert out.text in choice, (choice, out.text)


def test_json_object_gives_a_json_object_and_a_lark_grammar_its_language(llm, prompts):
    outs = _run(llm, prompts, [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(grammar='start: "x" D D\n'
                                                                  'D: /[0-9]/')),
        _params(2, json={"type": "object", "properties": {"k": {"enum": [1, 2]}},
                         "required": ["k"], "additionalProperties": False}),
    ])
    assert re.fullmatch(r"x[0-9][0-9]", outs[0].text)
    assert json.loads(outs[1].text) in ({"k": 1}, {"k": 2})


def test_unconstrained_greedy_output_is_unchanged_beside_constrained_requests(llm, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.token_ids for o in _run(llm, [prompts[0], prompts[2]], [greedy, greedy])]
    mixed = _run(llm, prompts, [greedy, _params(0, regex="[a-z]{3}[0-9]{2}"), greedy,
                                _params(1, choice=["yes", "no"])])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert re.fullmatch("[a-z]{3}[0-9]{2}", mixed[1].text) and mixed[3].text in ("yes", "no")


@pytest.mark.parametrize("structured, field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
     "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
])
def test_a_malformed_constraint_is_a_parameter_error_naming_its_field(llm, structured, field):
    with pytest.raises(ParameterError) as err:
        llm.generate("hello", SamplingParams(structured_outputs=StructuredOutputsParams(
            **structured)), use_tqdm=False)
    assert err.value.field == field


def test_nothing_compiles_after_warmup_with_constrained_requests_mixed_in(llm, prompts):
    with recorded_compilations() as compiles:
        outs = _run(llm, prompts, [
            _params(0, regex="[a-z]{4}"),
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=8,
                           logprobs=2, structured_outputs=StructuredOutputsParams(
                               choice=["alpha", "beta"])),
            SamplingParams(temperature=0.7, presence_penalty=0.5, max_tokens=9,
                           structured_outputs=StructuredOutputsParams(json_object=True)),
            SamplingParams(temperature=0.0, max_tokens=6, logit_bias={20: 5.0}),
        ])
    assert re.fullmatch("[a-z]{4}", outs[0].text) and outs[1].text in ("alpha", "beta")
    assert compiles == []


def test_constrained_steps_run_ahead_with_the_forward_launched_before_the_tokens_return(
        llm, prompts):
    core = llm.llm_engine.engine_core.engine_core
    assert core.async_scheduling
    runner = core.model_runner
    ahead = []
    dispatch = runner.dispatch

    def spy(so, sample=True):
        if not sample:  # a constrained step: was the previous one still in flight?
            ahead.append(core._inflight is not None)
        return dispatch(so, sample)

    runner.dispatch = spy
    try:
        outs = _run(llm, prompts, [_params(0, regex="[a-z]{6}"),
                                   SamplingParams(temperature=0.0, max_tokens=6),
                                   _params(1, choice=["abcdef", "xyz"])])
    finally:
        del runner.dispatch
    assert re.fullmatch("[a-z]{6}", outs[0].text) and outs[2].text in ("abcdef", "xyz")
    assert sum(ahead) >= 4, ahead  # decode steps overlapped the step before them


def test_synchronous_scheduling_gives_the_same_constrained_outputs(model_dir, llm, prompts):
    params = [_params(i, json={"type": "array", "items": {"type": "integer", "minimum": 0,
                                                         "maximum": 9},
                               "minItems": 2, "maxItems": 4}) for i in range(4)]
    ahead = [o.token_ids for o in _run(llm, prompts, params)]
    sync = LLM(model_dir, **SETTINGS, async_scheduling=False)
    assert [o.token_ids for o in _run(sync, prompts, params)] == ahead
    for out in _run(sync, prompts, params):
        validate(params[0].structured_outputs.json, json.loads(out.text))


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind(llm):
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}}
    engine.add_request("waiting", "hi", SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema)))
    assert "waiting" in core._awaiting_grammar and engine.has_unfinished_requests()
    engine.abort_request("waiting")
    assert not core._awaiting_grammar and "waiting" not in core.structured.matchers
    assert "waiting" not in core.scheduler.requests
    outs = []
    for _ in range(5):  # a step of earlier requests may still be in flight
        if not core.has_unfinished_requests():
            break
        outs += core.step().outputs
    assert not core.has_unfinished_requests()
    assert not any(o.request_id == "waiting" for o in outs)
