"""Tool calling in /v1/chat/completions: a request's tool plan, and each choice's text
turned into `message.tool_calls` (whole) or `delta.tool_calls` (streamed), as vLLM.

`finish_reason` becomes "tool_calls" when the auto parser found calls, or for
`required` when the output ended normally; a named choice keeps the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage
from jaxllm.entrypoints.openai.tool_parsers import (
    RequiredToolParser,
    StreamDelta,
    ToolParser,
    ToolStream,
    get_tool_parser,
)
from jaxllm.entrypoints.openai.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    tool_call_id,
)
from jaxllm.entrypoints.openai.tools import (
    ToolChoice,
    check_tools,
    choice_schema,
    resolve_choice,
)
from jaxllm.errors import ParameterError
from jaxllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolSettings:
    """The server's `--enable-auto-tool-choice` and `--tool-call-parser`."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at startup
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ParameterError("tool_call_parser",
                                 "--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with tools: the tools to render and how to read the output."""

    tools: list[dict[str, Any]]
    choice: ToolChoice
    parallel: bool = True
    parser_name: str | None = None

    @classmethod
    def of(cls, req: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
        tools = check_tools(req.tools)
        choice = resolve_choice(req.tool_choice, tools)
        if choice.mode == "auto" and not settings.enable_auto_tool_choice:
            raise ParameterError("tool_choice", '"auto" tool choice requires '
                                 "--enable-auto-tool-choice and --tool-call-parser to be set")
        if choice.mode in ("required", "named") and (
                req.structured_outputs is not None
                or (req.response_format is not None and req.response_format.type != "text")):
            raise ParameterError("tool_choice", f"{req.tool_choice!r} constrains the output "
                                 "itself; it cannot be combined with response_format or "
                                 "structured_outputs")
        return cls(tools, choice, req.parallel_tool_calls is not False,
                   settings.tool_call_parser if choice.mode == "auto" else None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools or None

    def constraint(self) -> StructuredOutputsParams | None:
        schema = choice_schema(self.choice, self.tools)
        return None if schema is None else StructuredOutputsParams(json=schema)

    def keeps_special_tokens(self) -> bool:
        parser = self.parser()
        return parser is not None and parser.keeps_special_tokens

    def parser(self) -> ToolParser | None:
        if self.choice.mode == "required":
            return RequiredToolParser()
        if self.parser_name is not None:
            return get_tool_parser(self.parser_name)
        return None

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool_calls, finish_reason) of one whole choice."""
        mode = self.choice.mode
        if mode == "named":
            assert self.choice.name is not None
            return "", [ToolCall(function=FunctionCall(name=self.choice.name,
                                                       arguments=text))], finish_reason
        parser = self.parser()
        if parser is None:
            return text, [], finish_reason
        found = parser.extract(text)
        if not found.calls:
            return text, [], finish_reason
        calls = found.calls if self.parallel else found.calls[:1]
        body = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls]
        if mode == "required":
            return "", body, "tool_calls" if finish_reason == "stop" else finish_reason
        return found.content, body, "tool_calls"


class ChoiceToolStream:
    """One streamed choice under a tool plan: text in, DeltaMessages out."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        parser = plan.parser()
        self.stream = ToolStream(parser) if parser is not None else None
        self.named_started = False

    @property
    def called(self) -> bool:
        if self.plan.choice.mode == "named":
            return self.named_started
        return self.stream is not None and bool(self.stream.sent_names)

    def feed(self, text: str) -> list[DeltaMessage]:
        if self.plan.choice.mode == "named":
            return self._named(text)
        if self.stream is None:
            return [DeltaMessage(content=text)]
        return self._deltas(self.stream.feed(text))

    def finish(self) -> list[DeltaMessage]:
        if self.plan.choice.mode == "named":
            return self._named("", final=True)
        if self.stream is None:
            return []
        return self._deltas(self.stream.finish())

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason is None:
            return None  # not the choice's last chunk, although a call may be under way
        mode = self.plan.choice.mode
        if mode == "auto" and self.called:
            return "tool_calls"
        if mode == "required" and self.called and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def _named(self, text: str, final: bool = False) -> list[DeltaMessage]:
        out = []
        if not self.named_started and (text or final):
            self.named_started = True
            out.append(_header(0, self.plan.choice.name or ""))
        if text:
            out.append(_arguments(0, text))
        return out

    def _deltas(self, step: StreamDelta) -> list[DeltaMessage]:
        """The content, then each call's name and argument fragments, as DeltaMessages."""
        out = [DeltaMessage(content=step.content)] if step.content else []
        for call in step.calls:
            if call.index > 0 and not self.plan.parallel:
                continue
            if call.name is not None:
                out.append(_header(call.index, call.name))
            if call.arguments:
                out.append(_arguments(call.index, call.arguments))
        return out


def _header(index: int, name: str) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(
        index=index, id=tool_call_id(), type="function", function=DeltaFunctionCall(name=name))])


def _arguments(index: int, fragment: str) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(
        index=index, function=DeltaFunctionCall(arguments=fragment))])
