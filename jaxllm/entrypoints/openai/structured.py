"""Structured outputs in the OpenAI bodies: `response_format` and vLLM's `structured_outputs`.

Both become one `StructuredOutputsParams`; the grammar itself is checked by
the engine's frontend, whose error `SamplingFields.structured_error` renames
to the field the client used.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jaxllm.errors import ParameterError
from jaxllm.sampling_params import StructuredOutputsParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    # OpenAI's name is `schema`, which pydantic's BaseModel reserves.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


def structured_params(response_format: ResponseFormat | None,
                       structured: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """The request's constraint: vLLM's `structured_outputs`, else OpenAI's `response_format`."""
    if structured is not None:
        if not isinstance(structured, dict):
            raise ParameterError("structured_outputs", "must be an object")
        known = set(StructuredOutputsParams.__struct_fields__)
        unknown = sorted(set(structured) - known)
        if unknown:
            raise ParameterError("structured_outputs", f"unknown fields {unknown}")
        if response_format is not None and response_format.type != "text":
            raise ParameterError("response_format", "give either response_format or "
                                 "structured_outputs, not both")
        values = {k: v for k, v in structured.items() if v is not None}
        try:
            return StructuredOutputsParams(**values)
        except TypeError as e:
            raise ParameterError("structured_outputs", str(e)) from e
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "json_schema":
        fmt = response_format.json_schema
        if fmt is None or fmt.json_schema is None:
            raise ParameterError("response_format.json_schema",
                                 "needs a 'schema' for type 'json_schema'")
        return StructuredOutputsParams(json=fmt.json_schema)
    raise ParameterError("response_format", f"type {response_format.type!r} is not supported "
                         "(text, json_object or json_schema)")
