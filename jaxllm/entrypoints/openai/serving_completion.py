"""/v1/completions: one engine request per prompt, choices indexed prompt * n + i."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from jaxllm.engine.input_processor import PromptType
from jaxllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from jaxllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    error_body,
    prompt_logprobs_body,
    raise_if_failed,
    random_id,
    sse,
    usage,
)
from jaxllm.errors import EngineDeadError, ParameterError
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    out: list[PromptType] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p:
            out.append({"prompt_token_ids": p})
        else:
            raise ParameterError("prompt", "each prompt must be a string or a non-empty "
                                 "list of token ids")
    return out


def _token_str(tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{tid}"


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        k: int, offset: int,
                        decode: Callable[[int], str] | None = None) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: chosen token, its logprob, the top k, text offsets."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs, strict=False):
        if entry is None:  # the first prompt token has no logprob
            tok = decode(tid) if decode is not None else f"token_id:{tid}"
            out.tokens.append(tok)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(tok)
            continue
        chosen = entry.get(tid)
        tok = _token_str(tid, chosen) if chosen else f"token_id:{tid}"
        out.tokens.append(tok)
        out.token_logprobs.append(chosen.logprob if chosen else None)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        top = {_token_str(t, lp): lp.logprob for t, lp in ranked[:k]}
        if chosen:
            top.setdefault(tok, chosen.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


class OpenAIServingCompletion(OpenAIServing):
    def _tokenized(self, prompt: PromptType, add_special_tokens: bool) -> PromptType:
        """A text prompt with its token ids, BOS and the like only if `add_special_tokens`."""
        if not isinstance(prompt, str) or self.tokenizer is None:
            return prompt  # token ids as given; without a tokenizer the engine says why not
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        return {"prompt": prompt, "prompt_token_ids": ids}

    def _decode(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=True)

    def _prompt_text(self, out: RequestOutput) -> str:
        """The echoed prompt: as sent, or decoded when it came as token ids (as vLLM)."""
        if out.prompt is not None or self.tokenizer is None:
            return out.prompt or ""
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True)

    async def create_completion(self, req: CompletionRequest
                                ) -> CompletionResponse | AsyncIterator[str]:
        model = self.check_model(req.model)
        req.check()
        # echo with max_tokens=0 scores the prompt alone (loglikelihood harnesses): the engine
        # runs one step, whose token the answer leaves out, as vLLM does.
        echo_only = req.echo and req.max_tokens == 0
        if echo_only and req.min_tokens:
            raise ParameterError("min_tokens", "must be 0 when echo is true and max_tokens is 0")
        params = req.to_sampling_params(1 if echo_only else req.max_tokens, req.logprobs,
                                        self.default_sampling())
        if req.echo and req.logprobs is not None:
            # Echoed logprobs come from the prompt's; an explicit prompt_logprobs may want more.
            params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
        prompts = [self._tokenized(p, req.add_special_tokens) for p in _prompts(req.prompt)]
        request_id = random_id("cmpl")
        try:
            requests = self.add_requests(request_id, prompts, params, req.priority,
                                         model=model)
        except ParameterError as e:
            raise req.structured_error(e) from e
        if req.stream:
            return self._stream(req, request_id, model, requests, echo_only)
        finals = await self.collect(requests)
        return self._response(req, request_id, model, finals, echo_only)

    def _response(self, req: CompletionRequest, request_id: str, model: str,
                  finals: list[RequestOutput], echo_only: bool = False) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = 0
        for i, out in enumerate(finals):
            raise_if_failed(out)
            prompt_tokens += len(out.prompt_token_ids)
            for comp in out.outputs:
                if echo_only:
                    comp = _without_generation(comp)
                completion_tokens += len(comp.token_ids)
                text, logprobs = comp.text, None
                prefix = self._prompt_text(out) if req.echo else ""
                if req.logprobs is not None and comp.logprobs is not None:
                    logprobs = completion_logprobs(comp.token_ids, comp.logprobs,
                                                   req.logprobs, len(prefix))
                    if req.echo and out.prompt_logprobs is not None:
                        echoed = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                     req.logprobs, 0, self._decode)
                        logprobs = _concat(echoed, logprobs)
                choice = CompletionChoice(
                    index=i * req.n + comp.index, text=prefix + text, logprobs=logprobs,
                    finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                    prompt_logprobs=prompt_logprobs_body(out, req.prompt_logprobs))
                if req.return_token_ids:
                    choice.token_ids = comp.token_ids
                choices.append(choice)
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens))

    async def _stream(self, req: CompletionRequest, request_id: str, model: str,
                      requests: list, echo_only: bool = False) -> AsyncIterator[str]:
        created = int(time.time())
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        try:
            async for i, out in self.iterate(requests):
                prompt_tokens[i] = len(out.prompt_token_ids)
                for comp in out.outputs:
                    if echo_only:
                        comp = _without_generation(comp)
                    idx = i * req.n + comp.index
                    first = idx not in offsets
                    text = comp.text
                    logprobs = None
                    if first and req.echo:
                        text = self._prompt_text(out) + text
                    offset = offsets.get(idx, 0)
                    if req.logprobs is not None and comp.logprobs is not None:
                        logprobs = completion_logprobs(
                            comp.token_ids, comp.logprobs, req.logprobs,
                            offset + (len(self._prompt_text(out)) if first and req.echo else 0))
                        if first and req.echo and out.prompt_logprobs is not None:
                            logprobs = _concat(completion_logprobs(
                                out.prompt_token_ids, out.prompt_logprobs, req.logprobs, 0,
                                self._decode), logprobs)
                    offsets[idx] = offset + len(text)
                    completion_tokens[idx] = completion_tokens.get(idx, 0) + len(comp.token_ids)
                    if not text and not comp.token_ids and comp.finish_reason is None:
                        continue
                    if comp.finish_reason == "error":
                        yield sse(error_body(400, f"the request failed in the engine: "
                                             f"{comp.stop_reason}", "prompt").model_dump_json())
                        continue
                    choice = CompletionChoice(index=idx, text=text, logprobs=logprobs,
                                              finish_reason=comp.finish_reason,
                                              stop_reason=comp.stop_reason)
                    if req.return_token_ids:
                        choice.token_ids = comp.token_ids
                    chunk = CompletionResponse(id=request_id, created=created, model=model,
                                               choices=[choice])
                    if continuous:
                        chunk.usage = usage(sum(prompt_tokens.values()),
                                            sum(completion_tokens.values()))
                    yield sse(chunk.model_dump_json())
            if include_usage:
                chunk = CompletionResponse(id=request_id, created=created, model=model,
                                           choices=[],
                                           usage=usage(sum(prompt_tokens.values()),
                                                       sum(completion_tokens.values())))
                yield sse(chunk.model_dump_json())
        except EngineDeadError as e:
            yield sse(error_body(503, str(e)).model_dump_json())
        yield sse("[DONE]")


def _without_generation(comp: CompletionOutput) -> CompletionOutput:
    """The choice of an echo-only request: its one engine token dropped; whatever ended it,
    the answer ends by length (zero tokens of max_tokens=0), unless it failed or was aborted."""
    finish = comp.finish_reason
    if finish == "stop":
        finish = "length"
    return dataclasses.replace(comp, text="", token_ids=[],
                               logprobs=[] if comp.logprobs is not None else None,
                               finish_reason=finish, stop_reason=None)


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs, tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs)
