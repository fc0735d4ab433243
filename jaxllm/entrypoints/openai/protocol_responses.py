"""/v1/responses bodies (OpenAI's Responses API, as vLLM serves it) and their translation
to the chat pipeline.

A request's `input` (a string, or a list of items: messages, earlier function calls and
their outputs) becomes chat messages, its fields a ChatCompletionRequest, so that the
chat template, tool plan, reasoning split and sampling are the chat endpoint's own. An
error found there names the Responses field (`chat_errors_renamed`). Output items are
built here as plain dicts in OpenAI's shapes.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel
from jaxllm.entrypoints.openai.serving_engine import HTTPError
from jaxllm.errors import ParameterError

# `include` values; the others OpenAI defines name tools jaxllm does not run.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
          "developer": "system"}  # chat templates know no developer role
_TEXT_PARTS = ("input_text", "output_text", "text")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}, passed to the template
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = "disabled"
    background: bool = False
    service_tier: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    priority: int = 0

    def check(self) -> None:
        self.check_strings()
        if self.background:
            raise ParameterError("background", "background responses are not supported")
        if self.truncation == "auto":
            raise ParameterError("truncation", "only 'disabled' is supported: a prompt "
                                 "longer than the context is an error")
        for i, name in enumerate(self.include or ()):
            if name not in INCLUDABLE:
                raise ParameterError(f"include[{i}]", f"{name!r} is not supported "
                                     f"(supported: {', '.join(INCLUDABLE)})")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise ParameterError("input", "must not be empty")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def text_format(self) -> dict[str, Any]:
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ParameterError("text.format", "must be an object with a 'type'")
        return fmt

    def to_chat(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one runs as (n = 1; the stream's deltas as chat's)."""
        fmt = self.text_format()
        response_format: dict[str, Any] = {"type": fmt["type"]}
        if fmt["type"] == "json_schema":
            response_format["json_schema"] = {k: fmt.get(k) for k in
                                              ("name", "description", "schema", "strict")}
        kwargs: dict[str, Any] = {}
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs["reasoning_effort"] = effort  # read by templates that take it (GPT-OSS)
        return ChatCompletionRequest(
            messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            logprobs=self.wants_logprobs,
            top_logprobs=(self.top_logprobs or 0) if self.wants_logprobs else None,
            tools=[_chat_tool(t) for t in self.tools] if self.tools is not None else None,
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls, response_format=response_format,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            seed=self.seed, stop=self.stop, priority=self.priority, user=self.user,
            chat_template_kwargs=kwargs or None)


def _chat_tool(tool: Any) -> Any:
    # Responses tools are flat ({type, name, parameters, ...}); chat nests the function.
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return tool  # check_tools names what is wrong with it
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


_RENAMES = [(re.compile(r"^messages(\[\d+\])?"), "input"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
            (re.compile(r"^(response_format|structured_outputs)(\.json_schema)?"), "text.format"),
            (re.compile(r"^tools(\[\d+\])\.function"), r"tools\1"),
            (re.compile(r"^tool_choice\.function"), "tool_choice")]


def responses_field(field: str) -> str:
    for pattern, repl in _RENAMES:
        field = pattern.sub(repl, field)
    return field


@contextmanager
def chat_errors_renamed() -> Iterator[None]:
    """Errors of the chat pipeline, naming the Responses request's fields instead."""
    try:
        yield
    except ParameterError as e:
        field = responses_field(e.field)
        message = e.message.replace("max_completion_tokens", "max_output_tokens")
        raise ParameterError(field, message) from e
    except HTTPError as e:
        if e.param is None:
            raise
        raise HTTPError(e.status, e.message.replace("max_completion_tokens",
                                                    "max_output_tokens"),
                        responses_field(e.param)) from e


# ------------------------------------------------------------------ input items


def _text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParameterError(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ParameterError(f"{where}[{j}].type", f"content part {kind!r} is not "
                                 "supported (only text: input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)


def _required_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ParameterError(f"{where}.{key}", "must be a non-empty string")
    return value


def input_messages(items: str | list[dict[str, Any]], earlier: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """Chat messages of a request's `input`, after the `earlier` conversation (a previous
    response's). Consecutive function calls join one assistant turn; an output must
    answer a call made before it. Reasoning items are dropped: chat templates leave
    earlier turns' thinking out."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    calls = {c["id"] for m in earlier for c in m.get("tool_calls") or ()}
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ParameterError(f"{where}.role", f"must be one of {sorted(_ROLES)}, "
                                     f"got {role!r}")
            out.append({"role": _ROLES[role], "content": _text(f"{where}.content",
                                                               item.get("content", ""))})
        elif kind == "function_call":
            call_id = _required_str(item, "call_id", where)
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise ParameterError(f"{where}.arguments", "must be a JSON string")
            try:
                json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                raise ParameterError(f"{where}.arguments", f"is not valid JSON: {e}") from e
            call = {"id": call_id, "type": "function", "function": {
                "name": _required_str(item, "name", where), "arguments": arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            if call_id not in calls:
                raise ParameterError(f"{where}.call_id", f"no function call with call_id "
                                     f"{call_id!r} comes before this output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(f"{where}.output", item.get("output", ""))})
        elif kind != "reasoning":
            raise ParameterError(f"{where}.type", f"input item type {kind!r} is not "
                                 "supported (message, function_call, function_call_output, "
                                 "reasoning)")
    return out


def assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant message the next turn's template reads."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


# ------------------------------------------------------------------ output items


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs if logprobs is not None else []}


def message_item(text: str, logprobs: list[dict[str, Any]] | None,
                 status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id("msg"), "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)]}


def function_call_item(call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_body(req: ResponsesRequest, response_id: str, model: str, created: int,
                  status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """The response object; `defaults`: the sampling values the request left unset."""
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
        "store": req.store, "background": False,
        "temperature": req.temperature if req.temperature is not None
        else defaults.get("temperature", 1.0),
        "top_p": req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
        "top_logprobs": req.top_logprobs, "text": {"format": req.text_format()},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "truncation": req.truncation or "disabled",
        "usage": usage, "user": req.user, "service_tier": req.service_tier or "auto",
    }


def usage_body(input_tokens: int, cached: int, output_tokens: int,
               reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}
