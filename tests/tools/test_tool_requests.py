"""`tools` and `tool_choice` in a chat request: checks (400s naming the field, through
the real app), the schemas `required` and named choices constrain the output with,
the template rendering, and the response/stream shapes built from parsed text."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from jaxllm.entrypoints.openai.api_server import ServerOptions, build_app
from jaxllm.entrypoints.openai.chat_tools import ChoiceToolStream, ToolPlan, ToolSettings
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.tools import (
    ToolChoice,
    check_tools,
    choice_schema,
    resolve_choice,
    template_messages,
)
from jaxllm.errors import ParameterError
from jaxllm.metrics.loggers import PrometheusStatLogger
from tests.models.tiny_checkpoints import make_tiny_tokenizer
from tests.tools.templates import TOOL_CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, CLOCK]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def plan(auto: bool = True, **kw) -> ToolPlan:
    return ToolPlan.of(request(**kw), ToolSettings(auto, "hermes" if auto else None))


# ----------------------------------------------------------------- choices and checks


def test_tools_without_tool_choice_mean_auto_and_none_without_tools():
    assert resolve_choice(None, TOOLS) == ToolChoice("auto")
    assert resolve_choice(None, []) == ToolChoice("none")
    assert resolve_choice("required", []) == ToolChoice("none")  # as OpenAI and vLLM
    named = {"type": "function", "function": {"name": "get_time"}}
    assert resolve_choice(named, TOOLS) == ToolChoice("named", "get_time")


@pytest.mark.parametrize("tools,field", [
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": ""}}], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}],
     "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    (["f"], "tools[0]"),
])
def test_malformed_tools_are_errors_naming_the_field(tools, field):
    with pytest.raises(ParameterError) as e:
        check_tools(tools)
    assert e.value.field == field


@pytest.mark.parametrize("choice,tools,field", [
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "tool_choice.function.name"),
    ({"type": "function"}, TOOLS, "tool_choice.function"),
    ("sometimes", TOOLS, "tool_choice"),
    ("auto", None, "tool_choice"),
    ({"type": "function", "function": {"name": "get_time"}}, None, "tool_choice"),
])
def test_bad_tool_choice_is_an_error_naming_the_field(choice, tools, field):
    with pytest.raises(ParameterError) as e:
        plan(tools=tools, tool_choice=choice)
    assert e.value.field == field


def test_auto_needs_the_server_flags_as_in_vllm():
    with pytest.raises(ParameterError, match="--enable-auto-tool-choice"):
        plan(auto=False, tools=TOOLS)
    assert plan(auto=False, tools=TOOLS, tool_choice="none").choice.mode == "none"
    assert plan(auto=False, tools=TOOLS, tool_choice="required").choice.mode == "required"


def test_required_and_named_cannot_be_combined_with_another_constraint():
    with pytest.raises(ParameterError, match="response_format"):
        plan(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    # auto leaves the output free, so a response_format still applies
    assert plan(tools=TOOLS, response_format={"type": "json_object"}).choice.mode == "auto"


def test_hermes_auto_keeps_special_tokens_in_the_text_as_vllm():
    assert plan(tools=TOOLS).keeps_special_tokens()
    assert not plan(tools=TOOLS, tool_choice="none").keeps_special_tokens()
    assert not plan(tools=TOOLS, tool_choice="required").keeps_special_tokens()
    llama = ToolPlan.of(request(tools=TOOLS), ToolSettings(True, "llama3_json"))
    assert not llama.keeps_special_tokens()


def test_server_settings_need_a_known_parser():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ToolSettings(True, "nope")
    with pytest.raises(ParameterError, match="--tool-call-parser"):
        ToolSettings(True, None)


# ----------------------------------------------------------------- HTTP 400s


class _FakeEngine:
    """Enough of AsyncLLM for requests that fail before reaching the engine."""

    errored = False

    class model_config:  # noqa: N801 - the attribute the routes read
        model = "/m"
        served_model_name = "m"
        max_model_len = 64
        generation_defaults: dict = {}
        supported_tasks = ("generate",)

    class config:  # noqa: N801 - the server reads its LoRA settings from it
        lora_config = None

    def get_tokenizer(self):
        return None


@pytest.fixture(scope="module")
def http() -> TestClient:
    options = ServerOptions(tools=ToolSettings())  # no --enable-auto-tool-choice
    return TestClient(build_app(_FakeEngine(), options, PrometheusStatLogger("m")))


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto by default, not enabled on this server
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}],
      "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
      "tool_choice": "none"}, "tools[0].function.parameters"),
])
def test_tool_errors_over_http_are_400s_naming_the_field(http, body, param):
    resp = http.post("/v1/chat/completions",
                     json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


# ----------------------------------------------------------------- schemas


def test_named_choice_constrains_the_output_to_that_functions_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert choice_schema(ToolChoice("named", "get_weather"), TOOLS) == \
        WEATHER["function"]["parameters"]
    assert plan(tools=TOOLS, tool_choice=named).constraint().json == \
        WEATHER["function"]["parameters"]
    # no parameters: an empty object
    assert choice_schema(ToolChoice("named", "get_time"), TOOLS) == \
        {"type": "object", "properties": {}}


def test_required_schema_is_a_nonempty_array_of_name_and_parameters_any_of_the_tools():
    schema = choice_schema(ToolChoice("required"), TOOLS)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "other", "parameters": {}}], [{"parameters": {}}],
                [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert plan(auto=False, tools=TOOLS, tool_choice="required").constraint().json == schema


def test_required_schema_hoists_defs_and_rejects_conflicting_ones():
    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}}}

    schema = choice_schema(ToolChoice("required"),
                           [tool("a", {"P": {"type": "integer"}}),
                            tool("b", {"P": {"type": "integer"}})])
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "a", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"p": "x"}}], schema)
    with pytest.raises(ParameterError) as e:
        choice_schema(ToolChoice("required"), [tool("a", {"P": {"type": "integer"}}),
                                               tool("b", {"P": {"type": "string"}})])
    assert e.value.field == "tools[1].function.parameters.$defs.P"


# ----------------------------------------------------------------- rendering


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
]


def test_template_gets_tool_call_arguments_as_objects_as_in_vllm():
    msgs = template_messages(HISTORY)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    with pytest.raises(ParameterError) as e:
        template_messages([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}])
    assert e.value.field == "messages[0].tool_calls[0].function.arguments"


def test_request_messages_keep_tool_calls_and_tool_call_ids_for_the_template():
    req = ChatCompletionRequest(messages=HISTORY)
    text = make_tiny_tokenizer().apply_chat_template(
        template_messages(req.messages_as_dicts()), chat_template=TOOL_CHAT_TEMPLATE,
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert json.dumps(WEATHER) in text and json.dumps(CLOCK) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|tool|>call-1=sunny" in text


# ----------------------------------------------------------------- responses


def test_named_response_is_one_call_with_the_text_as_arguments_and_keeps_finish_reason():
    p = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls, finish = p.message('{"city": "Oslo"}', "stop")
    assert content == "" and finish == "stop"
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [("get_weather", '{"city": "Oslo"}')]
    assert calls[0].id.startswith("chatcmpl-tool-") and calls[0].type == "function"


def test_required_finish_reason_is_tool_calls_only_when_the_output_ended_normally():
    p = plan(tools=TOOLS, tool_choice="required")
    text = '[{"name": "get_time", "parameters": {}}]'
    assert p.message(text, "stop")[2] == "tool_calls"
    assert p.message(text, "length")[2] == "length"


def test_auto_response_has_the_calls_the_text_before_them_and_finish_tool_calls():
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
           "</tool_call>"
    content, calls, finish = plan(tools=TOOLS).message(text, "stop")
    assert content == "Checking." and finish == "tool_calls"
    assert calls[0].function.arguments == '{"city": "Oslo"}'
    assert plan(tools=TOOLS).message("no call", "stop") == ("no call", [], "stop")


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    p = plan(tools=TOOLS, parallel_tool_calls=False)
    assert len(p.message(block * 2, "stop")[1]) == 1
    stream = ChoiceToolStream(p)
    deltas = stream.feed(block * 2) + stream.finish()
    assert {d.tool_calls[0].index for d in deltas} == {0}


def test_stream_deltas_open_each_call_with_index_id_type_name_then_arguments():
    p = plan(tools=TOOLS)
    stream = ChoiceToolStream(p)
    deltas = stream.feed('Hi<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
                         '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    deltas += stream.finish()
    body = [d.model_dump() for d in deltas]
    assert body[0] == {"content": "Hi"}
    for i, name, args in ((0, "get_time", "{}"), (1, "get_weather", '{"city": "Oslo"}')):
        head, frag = body[1 + 2 * i]["tool_calls"][0], body[2 + 2 * i]["tool_calls"][0]
        assert head["index"] == i and head["type"] == "function"
        assert head["id"].startswith("chatcmpl-tool-")
        assert head["function"] == {"name": name}
        assert frag == {"index": i, "function": {"arguments": args}}
    assert stream.finish_reason("stop") == "tool_calls"


def test_named_stream_sends_the_text_as_argument_fragments():
    p = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    stream = ChoiceToolStream(p)
    deltas = stream.feed("{") + stream.feed('"a"') + stream.feed(": 1}") + stream.finish()
    calls = [d.tool_calls[0] for d in deltas]
    assert calls[0].function.name == "get_time" and calls[0].id
    assert "".join(c.function.arguments for c in calls[1:]) == '{"a": 1}'
    assert stream.finish_reason("stop") == "stop"  # as vLLM: named keeps the engine's
