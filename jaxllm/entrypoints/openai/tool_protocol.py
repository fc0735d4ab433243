"""OpenAI's tool-call bodies: `message.tool_calls` and the streamed `delta.tool_calls`."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def tool_call_id() -> str:
    """vLLM's id style for a tool call."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _omitted_when_none() -> Any:
    return Field(default=None, exclude_if=lambda v: v is None)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Body):
    name: str | None = _omitted_when_none()
    arguments: str | None = _omitted_when_none()


class DeltaToolCall(_Body):
    """The first delta of a call carries its index, id, type and name; the later ones
    the same index and fragments of the arguments."""

    index: int
    id: str | None = _omitted_when_none()
    type: Literal["function"] | None = _omitted_when_none()
    function: DeltaFunctionCall | None = _omitted_when_none()
