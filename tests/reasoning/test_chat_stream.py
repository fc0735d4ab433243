"""The chat stream over scripted engine outputs (no model): every way the engine may cut
a choice's text, the last piece empty included, gives the same assembled answer and
one finish reason, with a reasoning parser and without."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from jaxllm.entrypoints.openai.chat_tools import ToolPlan, ToolSettings
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.outputs import CompletionOutput, RequestOutput

TEXT = "<think>why</think>because"


def _serving(parser: str | None, tools: str | None) -> OpenAIServingChat:
    engine = SimpleNamespace(
        model_config=SimpleNamespace(model="m", generation_defaults={}),
        get_tokenizer=lambda: None, config=SimpleNamespace(reasoning_parser=parser))
    return OpenAIServingChat(engine, ["m"], tool_settings=ToolSettings(
        enable_auto_tool_choice=tools is not None, tool_call_parser=tools))


def scripted_stream(serving: OpenAIServingChat, pieces: list[str]) -> list[dict]:
    async def scripted(requests):
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield 0, RequestOutput("r", None, [1], None, [CompletionOutput(
                0, piece, [5] * len(piece), None, None, "stop" if last else None)], last)

    serving.iterate = scripted
    settings = serving.tool_settings
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}], stream=True,
                                tools=tools if settings.tool_call_parser else None)

    async def run() -> list[dict]:
        out = []
        async for line in serving._stream(req, "id", "m", [], "", ToolPlan.of(req, settings),
                                          "<|a|>"):
            body = line.removeprefix("data: ").strip()
            if body != "[DONE]":
                out.append(json.loads(body))
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("parser,tools,want", [
    (None, None, (None, TEXT)), ("qwen3", None, ("why", "because")),
    (None, "hermes", (None, TEXT)), ("qwen3", "hermes", ("why", "because"))])
def test_every_cut_of_the_stream_assembles_to_one_answer_and_one_finish(parser, tools, want):
    cuts = [[TEXT, ""], [TEXT[:3], TEXT[3:12], TEXT[12:], ""], [TEXT[:9], TEXT[9:]],
            list(TEXT) + [""]]
    for pieces in cuts:
        chunks = scripted_stream(_serving(parser, tools), pieces)
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        reasoning = "".join(d["delta"].get("reasoning") or "" for d in deltas) or None
        content = "".join(d["delta"].get("content") or "" for d in deltas) or None
        assert (reasoning, content) == want, pieces
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["stop"], pieces
        assert deltas[-1]["finish_reason"] == "stop"
