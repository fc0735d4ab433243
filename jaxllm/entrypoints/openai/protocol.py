"""OpenAI request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests check types here, and that every string is valid Unicode (JSON can
carry a lone UTF-16 surrogate, which no tokenizer or encoder takes); value
ranges are checked once, by SamplingParams, which names the offending field.
Unknown request fields are ignored, as the OpenAI API does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxllm.entrypoints.chat_content import content_text
from jaxllm.entrypoints.openai.strings import check_strings
from jaxllm.entrypoints.openai.structured import ResponseFormat, structured_params
from jaxllm.entrypoints.openai.tool_protocol import DeltaToolCall, ToolCall
from jaxllm.errors import ParameterError
from jaxllm.sampling_params import (
    INT64_MAX,
    LOGIT_BIAS_LIMIT,
    MAX_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    check_int,
)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def check_strings(self) -> None:
        """Every string in the body, keys included, is valid Unicode (see `strings.py`)."""
        check_strings(self)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    return_token_ids: bool = False  # adds the generated token ids to every choice
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs
    # (json, regex, choice, grammar, json_object, structural_tag).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_error(self, e: ParameterError) -> ParameterError:
        """A grammar the engine's frontend rejected, named by the field the client used."""
        if (e.field.startswith("structured_outputs") and self.structured_outputs is None
                and self.response_format is not None):
            field = ("response_format.json_schema.schema"
                     if self.response_format.type == "json_schema" else "response_format")
            return ParameterError(field, e.message)
        return e

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "only allowed when stream is true")

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           defaults: dict[str, Any]) -> SamplingParams:
        """`defaults`: the model's generation_config.json values for fields left unset."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        logit_bias = None
        if self.logit_bias:
            try:
                # Clamped to OpenAI's range, as vLLM does; SamplingParams rejects NaN.
                logit_bias = {int(k): max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v)))
                              if v == v else v for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise ParameterError("logit_bias", "keys must be token ids") from e
        if self.prompt_logprobs is not None and self.stream:
            raise ParameterError("prompt_logprobs", "not available with stream=true")
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured_params(self.response_format, self.structured_outputs),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)


# ------------------------------------------------------------------ /v1/completions


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        self.check_strings()
        self.check_stream_options()
        if self.suffix:
            raise ParameterError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ParameterError("best_of", f"only best_of == n is supported, got {self.best_of}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParameterError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ParameterError("prompt", "must not be empty")


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


def _omitted_when_none() -> Any:
    return Field(default=None, exclude_if=lambda v: v is None)


class PromptLogprob(OpenAIBaseModel):
    """One entry of vLLM's `prompt_logprobs`: keyed by token id in the enclosing dict."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: None for the first prompt token, then {token id: PromptLogprob} per token.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omitted_when_none()
    prompt_logprobs: PromptLogprobs | None = _omitted_when_none()


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------ /v1/chat/completions


class ContentPart(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by tools.check_tools, which names the field
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # As in vLLM, off by default: the chat template already writes BOS and the like.
    add_special_tokens: bool = False
    # vLLM's: under --reasoning-parser, whether the reasoning is returned at all.
    include_reasoning: bool = True

    def check(self) -> None:
        self.check_strings()
        self.check_stream_options()
        if not self.messages:
            raise ParameterError("messages", "must not be empty")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ParameterError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], "
                                     f"got {self.top_logprobs}")
            if not self.logprobs:
                raise ParameterError("top_logprobs", "needs logprobs=true")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, 1, INT64_MAX)
        if self.continue_final_message and self.add_generation_prompt:
            raise ParameterError("continue_final_message",
                                 "cannot be combined with add_generation_prompt=true")

    def effective_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are set.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": m.role,
                                   "content": content_text(f"messages[{i}].content", m.content)}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls is not None and m.role == "assistant":
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None and m.role == "tool":
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class ChatLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    # Under --reasoning-parser: vLLM's `reasoning`, and its older name that clients read.
    reasoning: str | None = _omitted_when_none()
    reasoning_content: str | None = _omitted_when_none()
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omitted_when_none()


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = _omitted_when_none()


class DeltaMessage(OpenAIBaseModel):
    role: str | None = _omitted_when_none()
    content: str | None = _omitted_when_none()
    reasoning: str | None = _omitted_when_none()
    reasoning_content: str | None = _omitted_when_none()
    tool_calls: list[DeltaToolCall] | None = _omitted_when_none()


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omitted_when_none()


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------ models, tokenizer


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (plain text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
