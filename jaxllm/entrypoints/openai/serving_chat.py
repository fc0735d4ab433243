"""/v1/chat/completions: render the chat template, generate, answer or stream deltas.

Under --reasoning-parser (jaxllm/reasoning.py) each choice's thinking is split from its
answer first; the tool parser reads the answer only."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from jaxllm.entrypoints.openai.chat_tools import ChoiceToolStream, ToolPlan, ToolSettings
from jaxllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobContent,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from jaxllm.entrypoints.openai.serving_engine import (
    HTTPError,
    OpenAIServing,
    error_body,
    prompt_logprobs_body,
    raise_if_failed,
    random_id,
    sse,
    usage,
)
from jaxllm.entrypoints.openai.tools import template_messages
from jaxllm.errors import EngineDeadError, ParameterError
from jaxllm.outputs import Logprob, RequestOutput
from jaxllm.reasoning import (
    DEFAULT_FOR_MODEL_TYPE,
    ReasoningSplitter,
    get_reasoning_format,
    make_splitter,
    split_reasoning,
)

# apply_chat_template's own arguments, which chat_template_kwargs cannot pass again.
_SET_BY_REQUEST = frozenset({"messages", "conversation", "chat_template", "tokenize",
                             "add_generation_prompt", "continue_final_message", "tools"})


def _chat_logprob(tid: int, lp: Logprob) -> ChatLogprob:
    tok = lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"
    return ChatLogprob(token=tok, logprob=max(lp.logprob, -9999.0),
                       bytes=list(tok.encode("utf-8", errors="replace")))


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  k: int) -> ChatChoiceLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        chosen = entry.get(tid) or Logprob(float("-inf"))
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:k]
        base = _chat_logprob(tid, chosen)
        content.append(ChatLogprobContent(
            token=base.token, logprob=base.logprob, bytes=base.bytes,
            top_logprobs=[_chat_logprob(t, lp) for t, lp in ranked]))
    return ChatChoiceLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, tool_settings: ToolSettings | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tool_settings = tool_settings or ToolSettings()
        name = getattr(getattr(self.engine, "config", None), "reasoning_parser", None)
        model_type = getattr(getattr(self.model_config, "hf_config", None), "model_type", None)
        name = name or DEFAULT_FOR_MODEL_TYPE.get(model_type)
        self.reasoning = None if name is None else get_reasoning_format(name)

    def keeps_special_tokens(self, plan: ToolPlan) -> bool:
        """Whether the output is decoded with its special tokens, which the tool parser or
        the harmony split reads."""
        return plan.keeps_special_tokens() or bool(self.reasoning and self.reasoning.harmony)

    @staticmethod
    def harmony_calls(plan: ToolPlan) -> bool:
        return plan.parser_name == "openai"

    def render(self, req: ChatCompletionRequest,
               tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """The prompt text and its token ids (the template usually writes the special
        tokens; `add_special_tokens` adds the tokenizer's as well)."""
        if self.tokenizer is None:
            raise ParameterError("messages", "the server runs without a tokenizer "
                                 "(--skip-tokenizer-init); use /v1/completions with token ids")
        kwargs = dict(req.chat_template_kwargs or {})
        taken = sorted(_SET_BY_REQUEST & kwargs.keys())
        if taken:
            raise ParameterError("chat_template_kwargs", f"{taken[0]!r} is set by the "
                                 "request's own field")
        if tools:
            kwargs["tools"] = tools
        text = self.engine.input_processor.apply_chat_template(
            template_messages(req.messages_as_dicts()), req.chat_template or self.chat_template,
            req.add_generation_prompt, continue_final_message=req.continue_final_message,
            **kwargs)
        return text, self.tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids

    async def create_chat_completion(self, req: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self.check_model(req.model)
        req.check()
        request_id = random_id("chatcmpl")
        plan, text, requests = self.start(
            req, request_id, model, "max_completion_tokens"
            if req.max_completion_tokens is not None else "max_tokens")
        echo = self._echo_text(req)
        if req.stream:
            return self._stream(req, request_id, model, requests, echo, plan, text)
        (final,) = await self.collect(requests)
        return self._response(req, request_id, model, final, echo, plan, text)

    def start(self, req: ChatCompletionRequest, request_id: str, model: str,
              max_tokens_field: str) -> tuple[ToolPlan, str, list]:
        """A checked chat request into the engine: (its tool plan, the rendered prompt, the
        added requests). Shared with /v1/responses, which runs as a chat request."""
        plan = ToolPlan.of(req, self.tool_settings)
        text, ids = self.render(req, plan.template_tools())
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = req.to_sampling_params(req.effective_max_tokens(), top, self.default_sampling())
        constraint = plan.constraint()
        if constraint is not None:
            params.structured_outputs = constraint
        if self.keeps_special_tokens(plan):
            params.skip_special_tokens = False
        try:
            requests = self.add_requests(
                request_id, [{"prompt": text, "prompt_token_ids": ids}], params, req.priority,
                max_tokens_field, model=model)
        except ParameterError as e:
            if constraint is not None and e.field.startswith("structured_outputs"):
                # The grammar came from the tools' parameter schemas.
                raise HTTPError(400, f"tools: the parameters schema is not usable: "
                                f"{e.message}", "tools") from e
            raise req.structured_error(e) from e
        return plan, text, requests

    @staticmethod
    def _echo_text(req: ChatCompletionRequest) -> str:
        # As in vLLM: echo repeats the last message when it is the assistant's own.
        if not req.echo:
            return ""
        last = req.messages_as_dicts()[-1]
        return last["content"] if last["role"] == "assistant" else ""

    def _response(self, req: ChatCompletionRequest, request_id: str, model: str,
                  out: RequestOutput, echo: str, plan: ToolPlan,
                  prompt: str) -> ChatCompletionResponse:
        raise_if_failed(out)
        choices = []
        for comp in out.outputs:
            logprobs = None
            if req.logprobs and comp.logprobs is not None:
                logprobs = chat_logprobs(comp.token_ids, comp.logprobs, req.top_logprobs or 0)
            reasoning, answer = None, comp.text
            if self.reasoning is not None:
                reasoning, answer = split_reasoning(self.reasoning, prompt, comp.text,
                                                    self.harmony_calls(plan))
                reasoning = reasoning if req.include_reasoning else None
            content, calls, finish = plan.message(answer or "", comp.finish_reason)
            if answer is None and not content:
                content = None  # all of it was reasoning
            if echo and content is not None:
                content = echo + content
            choices.append(ChatCompletionChoice(
                index=comp.index,
                message=ChatResponseMessage(content=content, reasoning=reasoning,
                                            reasoning_content=reasoning, tool_calls=calls),
                logprobs=logprobs, finish_reason=finish,
                stop_reason=comp.stop_reason,
                token_ids=comp.token_ids if req.return_token_ids else None))
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage(len(out.prompt_token_ids), num_generated),
                                      prompt_logprobs=prompt_logprobs_body(
                                          out, req.prompt_logprobs))

    async def _stream(self, req: ChatCompletionRequest, request_id: str, model: str,
                      requests: list, echo: str, plan: ToolPlan,
                      prompt: str) -> AsyncIterator[str]:
        created = int(time.time())
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        prompt_tokens = 0
        generated: dict[int, int] = {}
        tool_streams = [ChoiceToolStream(plan) for _ in range(req.n)]
        fmt = self.reasoning
        splitters = [make_splitter(fmt, prompt, self.harmony_calls(plan))
                     for _ in range(req.n)] if fmt is not None else None

        def chunk(choices: list[ChatStreamChoice], with_usage: bool = False) -> str:
            body: dict[str, Any] = {}
            if with_usage:
                body["usage"] = usage(prompt_tokens, sum(generated.values()))
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices,
                **body).model_dump_json())

        try:
            # The role comes first, in a chunk of its own for every choice.
            for i in range(req.n):
                yield chunk([ChatStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=echo))])
            async for _, out in self.iterate(requests):
                prompt_tokens = len(out.prompt_token_ids)
                for comp in out.outputs:
                    generated[comp.index] = generated.get(comp.index, 0) + len(comp.token_ids)
                    if comp.finish_reason == "error":
                        yield sse(error_body(400, f"the request failed in the engine: "
                                             f"{comp.stop_reason}", "prompt").model_dump_json())
                        continue
                    if not comp.text and not comp.token_ids and comp.finish_reason is None:
                        continue
                    logprobs = None
                    if req.logprobs and comp.logprobs is not None:
                        logprobs = chat_logprobs(comp.token_ids, comp.logprobs,
                                                 req.top_logprobs or 0)
                    tools = tool_streams[comp.index]
                    thought, answer = split_step(splitters, comp.index, comp.text,
                                                  comp.finish_reason is not None)
                    deltas = tools.feed(answer) if answer or splitters is None else []
                    if thought and req.include_reasoning:
                        deltas.insert(0, DeltaMessage(reasoning=thought,
                                                      reasoning_content=thought))
                    if comp.finish_reason is not None:
                        deltas += tools.finish()
                    elif not deltas and logprobs is None and not req.return_token_ids:
                        continue  # text held back by a parser; nothing to send yet
                    deltas = deltas or [DeltaMessage(content="")]
                    for k, delta in enumerate(deltas):
                        first, last = k == 0, k == len(deltas) - 1
                        choice = ChatStreamChoice(
                            index=comp.index, delta=delta,
                            logprobs=logprobs if first else None,
                            finish_reason=tools.finish_reason(comp.finish_reason)
                            if last else None,
                            stop_reason=comp.stop_reason if last else None,
                            token_ids=comp.token_ids if req.return_token_ids and first
                            else None)
                        yield chunk([choice], continuous)
            if include_usage:
                yield chunk([], with_usage=True)
        except EngineDeadError as e:
            yield sse(error_body(503, str(e)).model_dump_json())
        yield sse("[DONE]")


def split_step(splitters: list[ReasoningSplitter] | None, index: int, text: str,
                last: bool) -> tuple[str, str]:
    """(reasoning, answer) of one streamed piece of choice `index` (all answer without
    a reasoning parser); `last`: the choice's final piece, which flushes what was held."""
    if splitters is None:
        return "", text
    splitter = splitters[index]
    thought, answer = splitter.feed(text)
    if last:
        more_thought, more_answer = splitter.finish()
        thought, answer = thought + more_thought, answer + more_answer
    return thought, answer
