"""What the OpenAI endpoints share: model-name checks, HTTP errors, request fan-in.

Requests are added to the engine eagerly (so a bad prompt is a 400 before any
byte of a stream is sent) and read back through `iterate()`, which aborts
whatever is still running when the reader stops early (client disconnect).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jaxllm.engine.async_llm import AsyncLLM, RequestOutputCollector
from jaxllm.engine.input_processor import PromptType
from jaxllm.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    UsageInfo,
)
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams, check_text

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


class HTTPError(Exception):
    """An error the API answers with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, param=param, code=status,
                                         type=_ERROR_TYPES.get(status, "Error")))


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 chat_template: str | None = None):
        self.engine = engine
        self.model_config = engine.model_config
        self.served_model_names = list(served_model_names)
        # The model directory is accepted as a name too (clients often pass the path).
        self._accepted = set(self.served_model_names) | {self.model_config.model}
        self.chat_template = chat_template
        self.tokenizer = engine.get_tokenizer()
        # The server's LoRARegistry (serving_lora.py), shared by the endpoints: a
        # request's `model` may name an adapter.
        self.loras: Any = None

    def check_model(self, name: str | None) -> str:
        """The name to echo in responses; 404 for a model this server does not serve."""
        if not name:
            return self.served_model_names[0]
        check_text("model", name)
        if name not in self._accepted and (self.loras is None or not self.loras.get(name)):
            raise HTTPError(404, f"The model `{name}` does not exist.", "model")
        return name

    def default_sampling(self) -> dict[str, Any]:
        return self.model_config.generation_defaults

    def check_alive(self) -> None:
        if self.engine.errored:
            raise self.engine.dead_error

    def check_context(self, prompts: list[PromptType], params: SamplingParams,
                      field: str = "max_tokens") -> None:
        """A prompt plus `max_tokens` past the context is a 400 naming the limit, as in
        vLLM (the offline API caps it instead)."""
        limit = self.model_config.max_model_len
        if params.max_tokens is None:
            return
        for prompt in prompts:
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            if ids is None or len(ids) >= limit:
                continue  # measured by the engine, which names the prompt
            if len(ids) + params.max_tokens > limit:
                raise HTTPError(400, f"'{field}' is too large: {params.max_tokens}. This "
                                f"model's maximum context length is {limit} tokens and "
                                f"your request has {len(ids)} input tokens "
                                f"({params.max_tokens} > {limit} - {len(ids)})", field)

    def add_requests(self, request_id: str, prompts: list[PromptType], params: SamplingParams,
                     priority: int = 0, max_tokens_field: str = "max_tokens",
                     model: str | None = None) -> list[tuple[str, RequestOutputCollector]]:
        """Adds one engine request per prompt (with the LoRA adapter `model` names, if
        it names one); on any error none of them stays running."""
        self.check_alive()
        self.check_context(prompts, params, max_tokens_field)
        lora = self.loras.get(model) if self.loras is not None else None
        added: list[tuple[str, RequestOutputCollector]] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                added.append((rid, self.engine.add_request(rid, prompt, params, priority,
                                                           lora_request=lora)))
        except BaseException:
            self.engine.abort_now([rid for rid, _ in added])
            raise
        return added

    async def iterate(self, requests: list[tuple[str, RequestOutputCollector]]
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come; aborts the unfinished ones if left early."""
        unfinished = {rid for rid, _ in requests}
        try:
            if len(requests) == 1:
                rid, collector = requests[0]
                while unfinished:
                    out = collector.get_nowait() or await collector.get()
                    if out.finished:
                        unfinished.discard(rid)
                    yield 0, out
                return
            async for i, out in _merge(requests):
                if out.finished:
                    unfinished.discard(requests[i][0])
                yield i, out
        finally:
            if unfinished:
                self.engine.abort_now(list(unfinished))

    async def collect(self, requests: list[tuple[str, RequestOutputCollector]]
                      ) -> list[RequestOutput]:
        """The final output of every request (FINAL_ONLY requests)."""
        finals: list[RequestOutput | None] = [None] * len(requests)
        async for i, out in self.iterate(requests):
            if out.finished:
                finals[i] = out
        return [f for f in finals if f is not None]


async def _merge(requests: list[tuple[str, RequestOutputCollector]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Fans in several collectors; one waiter task per unfinished request."""
    tasks: dict[asyncio.Task, int] = {}
    try:
        for i, (_, collector) in enumerate(requests):
            tasks[asyncio.ensure_future(collector.get())] = i
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: tasks[t]):
                i = tasks.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    tasks[asyncio.ensure_future(requests[i][1].get())] = i
    finally:
        for task in tasks:
            task.cancel()


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def prompt_logprobs_body(out: RequestOutput, k: int | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` field: each prompt token and the top `k`, -inf as -9999.

    The engine may have computed more than `k` (echo with a larger `logprobs`);
    the extra entries are left out.
    """
    if k is None or out.prompt_logprobs is None:
        return None
    body: PromptLogprobs = []
    for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=False):
        if entry is None:
            body.append(None)
            continue
        body.append({t: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                                      decoded_token=lp.decoded_token)
                     for t, lp in entry.items() if t == tid or (lp.rank or 0) <= k})
    return body


def raise_if_failed(out: RequestOutput) -> None:
    """A request the core rejected (finish reason 'error') is the client's fault: 400."""
    for comp in out.outputs:
        if comp.finish_reason == "error":
            raise HTTPError(400, f"the request failed in the engine: {comp.stop_reason}",
                            "prompt")


__all__ = ["EngineDeadError", "HTTPError", "OpenAIServing", "error_body",
           "prompt_logprobs_body", "random_id", "sse", "usage"]
