"""OpenAI's /v1/embeddings request and response bodies (pydantic), with vLLM's extras."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from jaxllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    # A string, a list of strings, one list of token ids, or a list of them.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extra fields.
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # base64: the float32 little-endian bytes, as OpenAI's client decodes them.
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
