"""/v1/responses over scripted engine outputs (no model): input items to chat messages,
the Responses fields' errors, and the stream's events, each checked against the openai
package's own types, assembling to the whole answer for every cut of the text, with
reasoning, tool calls and an output cut off at max_output_tokens."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from openai.types.responses import ResponseOutputItem, ResponseStreamEvent
from pydantic import TypeAdapter

from jaxllm.entrypoints.openai.chat_tools import ToolPlan, ToolSettings
from jaxllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    chat_errors_renamed,
    input_messages,
    item_id,
)
from jaxllm.entrypoints.openai.serving_responses import (
    OpenAIServingResponses,
    ResponseStore,
    _Run,
)
from jaxllm.errors import ParameterError
from jaxllm.outputs import CompletionOutput, RequestOutput

EVENT = TypeAdapter(ResponseStreamEvent)
ITEM = TypeAdapter(ResponseOutputItem)
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _serving(parser: str | None = None, tools: str | None = None,
             store: ResponseStore | None = None) -> OpenAIServingResponses:
    engine = SimpleNamespace(
        model_config=SimpleNamespace(model="m", generation_defaults={}),
        get_tokenizer=lambda: (lambda text, add_special_tokens: SimpleNamespace(
            input_ids=text.split())),
        config=SimpleNamespace(reasoning_parser=parser))
    return OpenAIServingResponses(engine, ["m"], store=store, tool_settings=ToolSettings(
        enable_auto_tool_choice=tools is not None, tool_call_parser=tools))


def _outputs(pieces: list[str], finish: str) -> list[RequestOutput]:
    return [RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(
        0, piece, [5] * len(piece), None, None,  # a token a character
        finish if k == len(pieces) - 1 else None)], k == len(pieces) - 1, num_cached_tokens=2)
        for k, piece in enumerate(pieces)]


def _run(serving: OpenAIServingResponses, req: ResponsesRequest) -> _Run:
    chat = req.to_chat(input_messages(req.input, []))
    return _Run(req, item_id("resp"), "m", ToolPlan.of(chat, serving.tool_settings), "<|a|>",
                input_messages(req.input, []), 0)


def whole(serving, req, pieces, finish="stop") -> dict:
    return serving._whole(_run(serving, req), _outputs(["".join(pieces)], finish)[0])


def stream(serving, req, pieces, finish="stop") -> list[dict]:
    async def scripted(requests):
        for out in _outputs(pieces, finish):
            yield 0, out

    serving.iterate = scripted

    async def go() -> list[dict]:
        events = []
        async for line in serving._stream(_run(serving, req), []):
            kind, data = line.strip().split("\n")
            body = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {body['type']}"
            events.append(body)
        return events

    return asyncio.run(go())


def _checked(events: list[dict]) -> dict:
    """Validates every event and returns the final response (its usage left aside: the
    openai types ask for a cache-write count the engine has no notion of)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        if "response" in e:
            e = {**e, "response": {**e["response"], "usage": None}}
        EVENT.validate_python(e)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    return events[-1]["response"]


def _assembled(events: list[dict]) -> list[tuple[str, str]]:
    """(item type, text or arguments) of each item, from the deltas alone."""
    items: dict[int, list] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = [e["item"]["type"], ""]
        elif e["type"].endswith(".delta"):
            items[e["output_index"]][1] += e["delta"]
    return [tuple(items[i]) for i in sorted(items)]


def _items(body: dict) -> list[tuple[str, str]]:
    out = []
    for item in body["output"]:
        ITEM.validate_python(item)
        if item["type"] == "function_call":
            out.append(("function_call", item["arguments"]))
        else:
            out.append((item["type"], "".join(p["text"] for p in item["content"])))
    return out


def _cuts(text: str) -> list[list[str]]:
    return [[text, ""], [text[:3], text[3:12], text[12:], ""], [text[:9], text[9:]],
            list(text) + [""]]


REQ = ResponsesRequest(input="q", stream=True)


@pytest.mark.parametrize("parser,text,want", [
    (None, "an answer", [("message", "an answer")]),
    ("qwen3", "<think>why so</think>because", [("reasoning", "why so"),
                                               ("message", "because")]),
    ("qwen3", "<think>all thought</think>", [("reasoning", "all thought")]),
    ("openai_gptoss", "<|channel|>analysis<|message|>why so<|end|><|start|>assistant"
     "<|channel|>final<|message|>because", [("reasoning", "why so"), ("message", "because")])])
def test_every_cut_of_the_stream_gives_the_whole_answer_in_valid_events(parser, text, want):
    serving = _serving(parser)
    body = whole(serving, REQ, [text])
    assert _items(body) == want and body["status"] == "completed"
    for pieces in _cuts(text):
        events = stream(_serving(parser), REQ, pieces)
        final = _checked(events)
        assert _assembled(events) == want == _items(final), pieces
        assert events[-1]["type"] == "response.completed"
        assert final["usage"] == body["usage"]


def test_usage_counts_the_prompt_cache_and_the_reasoning():
    text = "<think>one two three</think>four"
    body = whole(_serving("qwen3"), REQ, [text])
    # The scripted tokenizer makes a token of each word of the reasoning text.
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2},
                             "output_tokens": len(text),
                             "output_tokens_details": {"reasoning_tokens": 3},
                             "total_tokens": 3 + len(text)}


def test_an_output_cut_off_is_incomplete_whole_and_streamed():
    body = whole(_serving(), REQ, ["so far"], finish="length")
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    events = stream(_serving(), REQ, ["so ", "far"], finish="length")
    final = _checked(events)
    assert events[-1]["type"] == "response.incomplete"
    assert final["status"] == "incomplete" and _items(final) == [("message", "so far")]


CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


@pytest.mark.parametrize("text,want", [
    (CALL, [("function_call", '{"x": 1}')]),
    ("let me see" + CALL + CALL, [("message", "let me see"), ("function_call", '{"x": 1}'),
                                  ("function_call", '{"x": 1}')])])
def test_tool_calls_are_function_call_items_whole_and_streamed(text, want):
    req = ResponsesRequest(input="q", tools=[TOOL], stream=True)
    body = whole(_serving(tools="hermes"), req, [text])
    assert _items(body) == want
    calls = [i for i in body["output"] if i["type"] == "function_call"]
    assert all(c["name"] == "f" and c["call_id"] for c in calls)
    assert len({c["call_id"] for c in calls}) == len(calls)
    for pieces in _cuts(text):
        events = stream(_serving(tools="hermes"), req, pieces)
        final = _checked(events)
        assert [(k, json.loads(v) if k == "function_call" else v)
                for k, v in _assembled(events)] == \
            [(k, json.loads(v) if k == "function_call" else v) for k, v in want], pieces
        done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert [e["name"] for e in done] == ["f"] * len(calls)
        assert [json.loads(a) for k, a in _items(final) if k == "function_call"] == \
            [{"x": 1}] * len(calls)


def test_a_named_tool_choice_streams_its_arguments():
    req = ResponsesRequest(input="q", tools=[TOOL], stream=True,
                           tool_choice={"type": "function", "name": "f"})
    events = stream(_serving(), req, ['{"x"', ': 2}', ""])
    final = _checked(events)
    assert _items(final) == [("function_call", '{"x": 2}')]
    assert final["output"][0]["name"] == "f"


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                "text": "b"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"y":1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "two"}]}]
    assert input_messages(items, []) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g",
                                                          "arguments": '{"y":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    # An output may answer a call of the conversation it continues.
    earlier = [{"role": "assistant", "tool_calls": [{"id": "c9"}]}]
    assert input_messages([{"type": "function_call_output", "call_id": "c9",
                            "output": "x"}], earlier)[0]["tool_call_id"] == "c9"


@pytest.mark.parametrize("items,field", [
    ([{"type": "web_search_call"}], "input[0].type"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
     "input[0].content[0].type"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}],
     "input[0].arguments"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id")])
def test_bad_input_items_name_their_field(items, field):
    with pytest.raises(ParameterError) as e:
        input_messages(items, [])
    assert e.value.field == field


@pytest.mark.parametrize("body,field", [
    (dict(input="q", background=True), "background"),
    (dict(input="q", truncation="auto"), "truncation"),
    (dict(input="q", include=["file_search_call.results"]), "include[0]"),
    (dict(input=[]), "input")])
def test_unsupported_fields_are_refused_by_name(body, field):
    with pytest.raises(ParameterError) as e:
        ResponsesRequest(**body).check()
    assert e.value.field == field


@pytest.mark.parametrize("body,field", [
    (dict(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(tools=[TOOL], tool_choice={"type": "function", "name": "g"}), "tool_choice.name"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format")])
def test_chat_pipeline_errors_name_the_responses_fields(body, field):
    req = ResponsesRequest(input="q", **body)
    with pytest.raises(ParameterError) as e, chat_errors_renamed():
        chat = req.to_chat(input_messages(req.input, []))
        ToolPlan.of(chat, ToolSettings(True, "hermes"))
        chat.to_sampling_params(None, None, {})
    assert e.value.field == field


def test_the_store_keeps_the_latest_within_its_bounds():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for k in range(3):
        store.put({"id": f"r{k}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and store.get("r2") is not None
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 20_000}])
    assert store.get("big") is None and store.get("r1") is not None
    assert store.delete("r1") and not store.delete("r1")
    kept = store.get("r2")
    kept[1].append("changed")
    assert len(store.get("r2")[1]) == 1  # a copy each time


def test_a_finished_response_is_kept_with_its_conversation():
    store = ResponseStore()
    body = whole(_serving(tools="hermes", store=store),
                 ResponsesRequest(input="q", tools=[TOOL]), ["hi" + CALL])
    kept, conversation = store.get(body["id"])
    assert kept == body
    assert conversation[0] == {"role": "user", "content": "q"}
    turn = conversation[1]
    assert turn["role"] == "assistant" and turn["content"] == "hi"
    assert turn["tool_calls"][0]["id"] == body["output"][1]["call_id"]
    assert store.get(whole(_serving(store=store), ResponsesRequest(input="q", store=False),
                           ["x"])["id"]) is None
