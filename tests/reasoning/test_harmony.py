"""GPT-OSS's harmony output (jaxllm/harmony.py): the `openai_gptoss` reasoning split and
the `openai` tool parser, whole and over every cut of a stream, through the chat
endpoint's stream with scripted engine outputs; the split is GPT-OSS's default."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from jaxllm.entrypoints.openai.chat_tools import ToolPlan, ToolSettings
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.tool_parsers import OpenAIToolParser
from jaxllm.harmony import HarmonySplitter
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.reasoning import REASONING_PARSERS, split_reasoning
from tests.reasoning.test_chat_stream import scripted_stream

FMT = REASONING_PARSERS["openai_gptoss"]
THINK = "<|channel|>analysis<|message|>User asks. Think.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4 degrees."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Oslo"}')
CALL_FIRST = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}'
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check."
BROWSE = "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|end|>"


def _split(text: str, calls: bool = False) -> tuple[str | None, str | None]:
    return split_reasoning(FMT, "<|start|>assistant", text, calls)


@pytest.mark.parametrize("text,want", [
    (THINK + FINAL, ("User asks. Think.", "It is 4 degrees.")),
    (THINK + FINAL + "<|return|>", ("User asks. Think.", "It is 4 degrees.")),
    # Cut off inside the thinking; a header not yet whole.
    ("<|channel|>analysis<|message|>Hmm", ("Hmm", None)),
    (THINK + "<|start|>assistant<|chan", ("User asks. Think.", None)),
    # Preambles are the user's; a built-in tool's call is not (jaxllm runs none).
    (THINK + PREAMBLE + "<|end|>" + BROWSE + FINAL, ("User asks. Think.{\"q\": 1}",
                                                    "Let me check.It is 4 degrees.")),
    # A function call without the tool parser is dropped.
    (THINK + CALL, ("User asks. Think.", None)),
    # No harmony at all (a grammar from the first token): all of it is the answer.
    ('{"a": 1}', (None, '{"a": 1}'))])
def test_harmony_messages_split_into_reasoning_and_answer(text, want):
    assert _split(text) == want


def _cuts(text: str) -> list[list[str]]:
    return [[text], [text[:7], text[7:40], text[40:]], list(text),
            [text[i:i + 5] for i in range(0, len(text), 5)]]


@pytest.mark.parametrize("text", [THINK + FINAL, THINK + PREAMBLE + "<|end|>" + CALL,
                                  THINK + CALL_FIRST, FINAL + "<|end|>" + BROWSE])
@pytest.mark.parametrize("calls", [False, True])
def test_every_cut_splits_as_the_whole(text, calls):
    want = _split(text, calls)
    for pieces in _cuts(text):
        splitter = HarmonySplitter(calls)
        reasoning, answer = "", ""
        for piece in pieces:
            r, a = splitter.feed(piece)
            reasoning, answer = reasoning + r, answer + a
        r, a = splitter.finish()
        assert (reasoning + r or None, answer + a or None) == want, pieces
        assert (splitter.reasoning, splitter.content) == want


def test_the_openai_parser_reads_the_calls_the_split_hands_on():
    _, answer = _split(THINK + PREAMBLE + "<|end|>" + CALL, calls=True)
    found = OpenAIToolParser().extract(answer)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == \
        [("get_weather", {"city": "Oslo"})]
    assert found.content == "Let me check."
    _, answer = _split(THINK + CALL_FIRST, calls=True)
    found = OpenAIToolParser().extract(answer)
    assert [(c.name, c.arguments) for c in found.calls] == [("get_time", "{}")]
    assert found.content is None
    plain = OpenAIToolParser().extract("just text")
    assert plain.calls == [] and plain.content == "just text"


def _serving(tools: str | None, model_type: str = "gpt_oss",
             parser: str | None = None) -> OpenAIServingChat:
    engine = SimpleNamespace(
        model_config=SimpleNamespace(model="m", generation_defaults={},
                                     hf_config=SimpleNamespace(model_type=model_type)),
        get_tokenizer=lambda: None, config=SimpleNamespace(reasoning_parser=parser))
    return OpenAIServingChat(engine, ["m"], tool_settings=ToolSettings(
        enable_auto_tool_choice=tools is not None, tool_call_parser=tools))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _request(serving: OpenAIServingChat, stream: bool) -> tuple[ChatCompletionRequest, ToolPlan]:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}], stream=stream,
                                tools=TOOLS if serving.tool_settings.tool_call_parser else None)
    return req, ToolPlan.of(req, serving.tool_settings)


@pytest.mark.parametrize("text", [THINK + FINAL, THINK + PREAMBLE + "<|end|>" + CALL])
def test_the_chat_stream_assembles_to_the_whole_answer(text):
    whole_req, plan = _request(_serving("openai"), False)
    out = RequestOutput("r", None, [1], None, [CompletionOutput(0, text, [5], None, None,
                                                                "stop")], True)
    msg = _serving("openai")._response(whole_req, "id", "m", out, "", plan,
                                       "<|start|>assistant").choices[0].message
    want_calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    for pieces in _cuts(text) + [[*_cuts(text)[1], ""]]:
        chunks = scripted_stream(_serving("openai"), pieces)
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        reasoning = "".join(d["delta"].get("reasoning") or "" for d in deltas)
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        names, args = [], {}
        for d in deltas:
            for call in d["delta"].get("tool_calls") or ():
                if call.get("function", {}).get("name"):
                    names.append(call["function"]["name"])
                args[call["index"]] = args.get(call["index"], "") + (
                    call.get("function", {}).get("arguments") or "")
        assert reasoning == msg.reasoning and (content or None) == msg.content, pieces
        assert list(zip(names, [args[i] for i in sorted(args)], strict=True)) == want_calls
        finish = [d["finish_reason"] for d in deltas if d["finish_reason"]]
        assert finish == ["tool_calls" if want_calls else "stop"]


def test_harmony_is_gpt_oss_default_and_keeps_special_tokens():
    serving = _serving(None)
    assert serving.reasoning is FMT
    assert serving.keeps_special_tokens(_request(serving, False)[1])
    assert _serving(None, model_type="llama").reasoning is None
    assert _serving(None, model_type="llama", parser="qwen3").reasoning.name == "qwen3"
