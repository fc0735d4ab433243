"""Tool calling in the request: checking `tools` and `tool_choice`, and the constraint
that `required` and a named function put on the output (as vLLM builds it).

`tool_choice` resolves to one of "none", "auto", "required" or a function
name. `required` and named choices are enforced by structured output: a named
choice constrains the output to that function's `parameters` schema, and
`required` to a non-empty JSON array of `{"name", "parameters"}` objects, one
schema per tool under `anyOf`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxllm.errors import ParameterError

_EMPTY_OBJECT = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    """The resolved `tool_choice`: a mode, and the function's name for a named choice."""

    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The request's tools, each `{"type": "function", "function": {...}}`, checked:
    a non-empty string name, an object (or absent) `parameters` schema."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ParameterError("tools", "must be a list of tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ParameterError(where, "must be an object")
        if tool.get("type", "function") != "function":
            raise ParameterError(f"{where}.type", f"only 'function' tools are supported, got "
                                 f"{tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ParameterError(f"{where}.function", "must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ParameterError(f"{where}.function.name", "must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ParameterError(f"{where}.function.parameters",
                                 "must be a JSON schema object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ParameterError(f"{where}.function.description", "must be a string")
    return tools


def resolve_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """vLLM's rules: no tool_choice with tools means "auto"; any choice but "none" needs
    tools; a named choice must name one of them; `required` with no tools is "none"."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ParameterError("tool_choice", f"must be one of {list(CHOICES)} or a named "
                                 f"function, got {tool_choice!r}")
        if tool_choice == "none":
            return ToolChoice("none")
        if not tools:
            if tool_choice == "required":
                return ToolChoice("none")  # as OpenAI and vLLM: nothing to require
            raise ParameterError("tool_choice", "needs `tools` to be set")
        return ToolChoice(tool_choice)
    usage = 'e.g. {"type": "function", "function": {"name": "my_function"}}'
    if not isinstance(tool_choice, dict):
        raise ParameterError("tool_choice", f"must be a string or a named function ({usage})")
    fn = tool_choice.get("function")
    if not isinstance(fn, dict):
        raise ParameterError("tool_choice.function", f"must be an object ({usage})")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ParameterError("tool_choice.function.name", "must be a non-empty string")
    if not tools:
        raise ParameterError("tool_choice", "needs `tools` to be set")
    if name not in {t["function"]["name"] for t in tools}:
        raise ParameterError("tool_choice.function.name",
                             f"{name!r} is not one of the request's tools")
    return ToolChoice("named", name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    # Missing or empty parameters: the arguments are an empty object, as in vLLM.
    return tool["function"].get("parameters") or dict(_EMPTY_OBJECT)


def choice_schema(choice: ToolChoice, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The JSON schema the output must follow for `required` and named choices, else None."""
    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return _parameters(tool)
    if choice.mode != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        params = dict(_parameters(tool))
        # $defs are hoisted to the top, where the references of every tool resolve.
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise ParameterError(f"tools[{i}].function.parameters.$defs.{name}",
                                     "another tool defines it differently")
            defs[name] = schema
        # Closed, unlike vLLM's: a call is its name and parameters, and an open object
        # lets a weak model run on in made-up keys until max_tokens.
        variants.append({"properties": {"name": {"type": "string",
                                                 "enum": [tool["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects, as chat templates expect
    (the OpenAI body carries them as JSON text; vLLM converts them the same way)."""
    out = []
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list):
            converted = []
            for j, call in enumerate(calls):
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str) and args:
                    try:
                        fn["arguments"] = json.loads(args)
                    except json.JSONDecodeError as e:
                        raise ParameterError(f"messages[{i}].tool_calls[{j}].function."
                                             "arguments", f"is not valid JSON: {e}") from e
                elif not args:
                    fn["arguments"] = {}
                converted.append({**call, "function": fn})
            msg = {**msg, "tool_calls": converted}
        out.append(msg)
    return out
