"""Tool calling over HTTP with the official openai client, on a tiny random model.

`required` and named choices must always yield arguments valid for the tools'
parameter schemas (fixed and hypothesis-drawn), and the streamed deltas must
assemble to the whole answer of the same greedy request. `auto` runs the hermes
parser on a real output, steered to a tool call by a `structured_outputs`
regex. The chat template renders the tools and the tool-call history.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import NamedTuple

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer
from tests.models.tiny_checkpoints import make_tiny_checkpoint, make_tiny_tokenizer
from tests.structured_output.schemas import json_schemas
from tests.tools.templates import TOOL_CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # a server for the module

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 5},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                              "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    model = make_tiny_checkpoint(tmp, arch="llama", max_position_embeddings=1024)
    template = tmp / "tools.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    srv = RemoteServer([model, *TINY_ENGINE_FLAGS, "--max-model-len", "1024",
                        "--max-num-seqs", "4", "--request-buckets", "4",
                        "--served-model-name", MODEL, "--chat-template", str(template),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def whole(client, **kw) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a greedy, non-streamed answer."""
    kw.setdefault("max_tokens", 200)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **kw)
    msg = resp.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    for c in msg.tool_calls or []:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
    return msg.content, calls, resp.choices[0].finish_reason


class Step(NamedTuple):
    """One engine step of a stream: the text its tokens decode to, and the argument
    fragments of each call that came in its chunks."""
    text: str
    fragments: dict[int, str]


STEPS: list[Step] = []  # the last stream's engine steps
TOKENIZER = make_tiny_tokenizer()  # the server's: one character a token


def streamed(client, **kw) -> tuple[str, list[tuple[str, str]], str]:
    """The same, assembled from the stream's deltas (content, then tool_calls by index).

    With `return_token_ids` each engine step's chunks open with its tokens, so the
    steps (however many a lagging reader had merged) are recorded in STEPS."""
    content, names, args, finish = "", {}, {}, None
    STEPS.clear()
    kw["extra_body"] = {**kw.get("extra_body", {}), "return_token_ids": True}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                temperature=0, max_tokens=200, stream=True,
                                                **kw):
        for choice in chunk.choices:
            token_ids = (choice.model_extra or {}).get("token_ids")
            if token_ids is not None:
                STEPS.append(Step(TOKENIZER.decode(token_ids, skip_special_tokens=True), {}))
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in names:  # a call opens with its id, type and name
                    assert tc.id and tc.type == "function" and tc.function.name
                    names[tc.index] = tc.function.name
                    args[tc.index] = ""
                fragment = (tc.function.arguments or "") if tc.function else ""
                args[tc.index] += fragment
                if fragment:
                    frags = STEPS[-1].fragments
                    frags[tc.index] = frags.get(tc.index, "") + fragment
            finish = choice.finish_reason or finish
    assert sorted(names) == list(range(len(names)))
    return content, [(names[i], args[i]) for i in sorted(names)], finish


def argument_spans(text: str, count: int) -> list[tuple[int, int]]:
    """Where each of `count` calls' arguments object lies in a `required` answer."""
    decoder, spans = json.JSONDecoder(), []
    for key in re.finditer(r'"parameters"\s*:\s*', text):
        _, end = decoder.raw_decode(text, key.end())
        spans.append((key.end(), end))
    assert len(spans) == count, text
    return spans


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def check_named(client, tools: list[dict], name: str) -> None:
    params = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    content, calls, finish = whole(client, tools=tools, tool_choice=named(name))
    assert finish == "stop" and content == ""
    [(got_name, arguments)] = calls
    assert got_name == name
    jsonschema.validate(json.loads(arguments), params)
    s_content, s_calls, s_finish = streamed(client, tools=tools, tool_choice=named(name))
    assert (s_content, s_calls, s_finish) == ("", calls, finish)
    # each step's text is sent as it comes, as arguments (exact, whatever the pacing)
    assert [s.fragments.get(0, "") for s in STEPS] == [s.text for s in STEPS]


def check_required(client, tools: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    content, calls, finish = whole(client, tools=tools, tool_choice="required")
    assert calls and content == "", (content, finish)
    assert finish == "tool_calls"
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])
    s_content, s_calls, s_finish = streamed(client, tools=tools, tool_choice="required")
    assert (s_content, s_calls, s_finish) == ("", calls, finish)
    # arguments stream as they are written: a call whose object a step ended inside
    # comes in more than one fragment
    ends = list(itertools.accumulate(len(s.text) for s in STEPS))
    for i, (start, end) in enumerate(argument_spans("".join(s.text for s in STEPS),
                                                    len(calls))):
        if any(start < e < end for e in ends):
            assert sum(i in s.fragments for s in STEPS) > 1, (i, STEPS)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_yields_valid_arguments_streamed_and_not(client, name):
    check_named(client, [WEATHER, CLOCK], name)


def test_required_tool_choice_yields_valid_calls_streamed_and_not(client):
    check_required(client, [WEATHER, CLOCK])


_OBJECT_SCHEMAS = json_schemas().filter(lambda s: s.get("type") == "object")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(params=_OBJECT_SCHEMAS)
def test_named_tool_choice_holds_for_drawn_parameter_schemas(client, params):
    check_named(client, [tool("f", params), CLOCK], "f")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(params=st.lists(_OBJECT_SCHEMAS, min_size=1, max_size=2))
def test_required_tool_choice_holds_for_drawn_parameter_schemas(client, params):
    # maxItems is not bounded: one call per tool keeps the greedy output short enough
    check_required(client, [tool(f"f{i}", p) for i, p in enumerate(params)])


STEERED = ('Let me check.<tool_call>{"name": "get_weather", "arguments": '
           '{"city": "Oslo", "unit": "c"}}</tool_call>')


def _regex(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in text)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_a_hermes_call_from_the_models_output(client, stream):
    body = {"structured_outputs": {"regex": _regex(STEERED)}}
    content, calls, finish = (streamed if stream else whole)(
        client, tools=[WEATHER, CLOCK], extra_body=body)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Oslo", "unit": "c"}')]
    assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_leaves_plain_text_and_malformed_calls_as_content(client, stream):
    for text in ("No tools needed.", '<tool_call>{"name": "get_weather", "arguments": }'):
        body = {"structured_outputs": {"regex": _regex(text)}}
        content, calls, finish = (streamed if stream else whole)(
            client, tools=[WEATHER], extra_body=body)
        assert (content, calls, finish) == (text, [], "stop")


def test_tool_choice_none_renders_the_tools_but_parses_nothing(client):
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'
    content, calls, finish = whole(client, tools=[CLOCK], tool_choice="none",
                                   extra_body={"structured_outputs": {"regex": _regex(text)}})
    assert (content, calls, finish) == (text, [], "stop")


def test_template_renders_tools_and_the_tool_call_history(client):
    history = [*MESSAGES,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call-1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    tok = make_tiny_tokenizer()
    want = tok.apply_chat_template(
        [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m
         else m for m in history],
        chat_template=TOOL_CHAT_TEMPLATE, tools=[WEATHER, CLOCK], tokenize=False,
        add_generation_prompt=True)
    assert "<|tool|>call-1=sunny" in want and json.dumps(CLOCK) in want
    resp = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, CLOCK],
                                          tool_choice="none", max_tokens=1)
    assert resp.usage.prompt_tokens == len(tok(want, add_special_tokens=False).input_ids)


def test_unknown_named_function_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice=named("nope"))
    assert e.value.body["param"] == "tool_choice.function.name"


def test_hermes_auto_keeps_special_tokens_in_the_parsed_text_as_vllm(client):
    # id 3 is the tiny tokenizer's special <unk>; decoding drops it unless kept
    forced = {"logit_bias": {3: 100}, "max_tokens": 2}
    auto, _, _ = whole(client, tools=[WEATHER], **forced)
    plain, _, _ = whole(client, tools=[WEATHER], tool_choice="none", **forced)
    assert (auto, plain) == ("<unk><unk>", "")
