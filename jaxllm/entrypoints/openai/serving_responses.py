"""/v1/responses: a chat request underneath (protocol_responses.py), answered as one
response object or as the Responses stream's events; finished responses are kept, within
a bound, for `previous_response_id` and `GET /v1/responses/{id}`.

The stream sends `response.created` and `response.in_progress`, then each output item
in turn (reasoning, the message, function calls): `output_item.added`, its part and
text or argument deltas, their `.done` events and `output_item.done`; last
`response.completed` (or `response.incomplete` at `max_output_tokens`) with the whole
response. Every event carries its `sequence_number`.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from jaxllm.entrypoints.arg_utils import DEFAULT_RESPONSES_STORE_SIZE
from jaxllm.entrypoints.openai.chat_tools import ChoiceToolStream, ToolPlan
from jaxllm.entrypoints.openai.protocol import DeltaMessage
from jaxllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    assistant_turn,
    chat_errors_renamed,
    function_call_item,
    input_messages,
    item_id,
    message_item,
    output_text,
    reasoning_item,
    response_body,
    usage_body,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat, chat_logprobs, split_step
from jaxllm.entrypoints.openai.serving_engine import HTTPError, raise_if_failed
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import RequestOutput
from jaxllm.reasoning import make_splitter, split_reasoning

STORE_BYTES = 64 << 20  # all kept responses and conversations together, as JSON


class ResponseStore:
    """The latest responses (body, and the conversation each ends), oldest out first
    past `max_entries` or STORE_BYTES."""

    def __init__(self, max_entries: int = DEFAULT_RESPONSES_STORE_SIZE,
                 max_bytes: int = STORE_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._kept: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(body)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere, as if evicted at once
        with self._lock:
            self._kept[body["id"]] = (body, conversation, size)
            self._bytes += size
            while len(self._kept) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, _, freed) = self._kept.popitem(last=False)
                self._bytes -= freed

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            kept = self._kept.get(response_id)
        return None if kept is None else copy.deepcopy(kept[:2])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            kept = self._kept.pop(response_id, None)
            if kept is not None:
                self._bytes -= kept[2]
        return kept is not None


@dataclass
class _Run:
    """One request on its way: what both answer shapes need."""

    req: ResponsesRequest
    response_id: str
    model: str
    plan: ToolPlan
    prompt: str
    history: list[dict[str, Any]]  # the conversation without the instructions
    created: int


class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, *args: Any, store: ResponseStore | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.store = store

    def stored(self, response_id: str, field: str = "response_id"
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        kept = self.store.get(response_id) if self.store is not None else None
        if kept is None:
            raise HTTPError(404, f"Response with id {response_id!r} not found.", field)
        return kept

    async def create_response(self, req: ResponsesRequest
                              ) -> dict[str, Any] | AsyncIterator[str]:
        model = self.check_model(req.model)
        req.check()
        earlier = (self.stored(req.previous_response_id, "previous_response_id")[1]
                   if req.previous_response_id else [])
        history = earlier + input_messages(req.input, earlier)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        response_id = item_id("resp")
        with chat_errors_renamed():
            chat = req.to_chat(system + history)
            chat.check()
            plan, prompt, requests = self.start(chat, response_id, model, "max_output_tokens")
        run = _Run(req, response_id, model, plan, prompt, history, int(time.time()))
        if req.stream:
            return self._stream(run, requests)
        (final,) = await self.collect(requests)
        return self._whole(run, final)

    # ------------------------------------------------------------------ whole

    def _whole(self, run: _Run, out: RequestOutput) -> dict[str, Any]:
        raise_if_failed(out)
        comp = out.outputs[0]
        reasoning, answer = None, comp.text
        if self.reasoning is not None:
            reasoning, answer = split_reasoning(self.reasoning, run.prompt, comp.text,
                                                self.harmony_calls(run.plan))
        content, calls, _ = run.plan.message(answer or "", comp.finish_reason)
        status = "incomplete" if comp.finish_reason == "length" else "completed"
        logprobs = None
        if run.req.wants_logprobs and comp.logprobs is not None:
            logprobs = _logprob_entries(comp.token_ids, comp.logprobs, run.req)
        items = [reasoning_item(reasoning, status)] if reasoning else []
        if content or not (calls or reasoning):
            items.append(message_item(content or "", logprobs, status))
        items += [function_call_item(c.id, c.function.name, c.function.arguments)
                  for c in calls]
        return self._finish(run, status, items, out, len(comp.token_ids), reasoning)

    def _finish(self, run: _Run, status: str, items: list[dict[str, Any]],
                out: RequestOutput | None, generated: int, reasoning: str | None
                ) -> dict[str, Any]:
        prompt_tokens = len(out.prompt_token_ids) if out is not None else 0
        cached = out.num_cached_tokens if out is not None else 0
        usage = usage_body(prompt_tokens, cached, generated, self._count(reasoning))
        body = response_body(run.req, run.response_id, run.model, run.created, status, items,
                             usage, self.default_sampling())
        if run.req.store and self.store is not None:
            self.store.put(body, run.history + [assistant_turn(items)])
        return body

    def _count(self, text: str | None) -> int:
        # The reasoning's tokens, counted by encoding its text again.
        if not text or self.tokenizer is None:
            return 0
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    # ------------------------------------------------------------------ stream

    async def _stream(self, run: _Run, requests: list) -> AsyncIterator[str]:
        ev = _Events()
        pending = response_body(run.req, run.response_id, run.model, run.created,
                                "in_progress", [], None, self.default_sampling())
        yield ev.emit("response.created", response=pending)
        yield ev.emit("response.in_progress", response=pending)
        fmt = self.reasoning
        splitters = ([make_splitter(fmt, run.prompt, self.harmony_calls(run.plan))]
                     if fmt is not None else None)
        tools = ChoiceToolStream(run.plan)
        last: RequestOutput | None = None
        generated, finish = 0, None
        try:
            async for _, out in self.iterate(requests):
                last, comp = out, out.outputs[0]
                generated += len(comp.token_ids)
                if comp.finish_reason == "error":
                    for line in ev.failed(pending, f"the request failed in the engine: "
                                          f"{comp.stop_reason}", "invalid_prompt"):
                        yield line
                    return
                if run.req.wants_logprobs and comp.logprobs is not None:
                    ev.logprobs += _logprob_entries(comp.token_ids, comp.logprobs, run.req)
                thought, answer = split_step(splitters, 0, comp.text,
                                              comp.finish_reason is not None)
                lines = ev.text("reasoning", thought) if thought else []
                deltas = tools.feed(answer) if answer or splitters is None else []
                if comp.finish_reason is not None:
                    finish = comp.finish_reason
                    deltas += tools.finish()
                for delta in deltas:
                    lines += ev.delta(delta)
                for line in lines:
                    yield line
        except EngineDeadError as e:
            for line in ev.failed(pending, str(e), "server_error"):
                yield line
            return
        status = "incomplete" if finish == "length" else "completed"
        ev.status = status
        for line in ev.close():
            yield line
        reasoning = "".join(part["text"] for item in ev.items if item["type"] == "reasoning"
                            for part in item["content"])
        body = self._finish(run, status, ev.items, last, generated, reasoning)
        yield ev.emit(f"response.{status}", response=body)


def _logprob_entries(token_ids: list[int], logprobs: list, req: ResponsesRequest
                     ) -> list[dict[str, Any]]:
    body = chat_logprobs(token_ids, logprobs, req.top_logprobs or 0)
    return [entry.model_dump() for entry in body.content or ()]


class _Events:
    """The stream's events, numbered, and the output item being written."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open item
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # not yet sent with a text delta
        self.sent_logprobs: list[dict[str, Any]] = []
        self.status = "completed"

    def emit(self, kind: str, **body: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **body})
        self.seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def _at(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.items)}

    def _open(self, item: dict[str, Any]) -> list[str]:
        lines = self.close()
        self.item, self.parts = item, []
        lines.append(self.emit("response.output_item.added", output_index=len(self.items),
                               item={**item, "status": "in_progress"}))
        if item["type"] == "message":
            lines.append(self.emit("response.content_part.added", **self._at(),
                                   content_index=0, part=output_text("", None)))
        elif item["type"] == "reasoning":
            lines.append(self.emit("response.content_part.added", **self._at(),
                                   content_index=0, part={"type": "reasoning_text",
                                                          "text": ""}))
        return lines

    def text(self, kind: str, delta: str) -> list[str]:
        lines = []
        if self.item is None or self.item["type"] != kind:
            item = (message_item("", None) if kind == "message" else reasoning_item(""))
            lines = self._open({**item, "content": []})
        self.parts.append(delta)
        if kind == "reasoning":
            lines.append(self.emit("response.reasoning_text.delta", **self._at(),
                                   content_index=0, delta=delta))
            return lines
        sent, self.logprobs = self.logprobs, []
        self.sent_logprobs += sent
        lines.append(self.emit("response.output_text.delta", **self._at(), content_index=0,
                               delta=delta, logprobs=sent))
        return lines

    def delta(self, delta: DeltaMessage) -> list[str]:
        if delta.content:
            return self.text("message", delta.content)
        lines: list[str] = []
        for call in delta.tool_calls or ():
            fn = call.function
            if call.id is not None:  # a call's first delta: its id and name
                name = (fn.name or "") if fn is not None else ""
                lines += self._open(function_call_item(call.id, name, "", "in_progress"))
            if fn is not None and fn.arguments:
                self.parts.append(fn.arguments)
                lines.append(self.emit("response.function_call_arguments.delta", **self._at(),
                                       delta=fn.arguments))
        return lines

    def close(self) -> list[str]:
        """Ends the open item, if any: its `.done` events, then `output_item.done`."""
        item = self.item
        if item is None:
            return []
        text, at = "".join(self.parts), self._at()
        if item["type"] == "message":
            self.sent_logprobs += self.logprobs
            self.logprobs = []
            part = output_text(text, self.sent_logprobs)
            lines = [self.emit("response.output_text.done", **at, content_index=0, text=text,
                               logprobs=self.sent_logprobs),
                     self.emit("response.content_part.done", **at, content_index=0, part=part)]
            item = {**item, "content": [part], "status": self.status}
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            lines = [self.emit("response.reasoning_text.done", **at, content_index=0, text=text),
                     self.emit("response.content_part.done", **at, content_index=0, part=part)]
            item = {**item, "content": [part], "status": self.status}
        else:
            lines = [self.emit("response.function_call_arguments.done", **at, arguments=text,
                               name=item["name"])]
            item = {**item, "arguments": text, "status": "completed"}
        lines.append(self.emit("response.output_item.done", output_index=at["output_index"],
                               item=item))
        self.items.append(item)
        self.item = None
        return lines

    def failed(self, pending: dict[str, Any], message: str, code: str) -> list[str]:
        body = {**pending, "status": "failed", "error": {"code": code, "message": message}}
        return [self.emit("error", code=code, message=message, param=None),
                self.emit("response.failed", response=body)]


def add_responses_routes(app: FastAPI, serving: OpenAIServingResponses, respond: Callable,
                         generate: Callable) -> None:
    """POST /v1/responses (through the server's `generate`); GET and DELETE
    /v1/responses/{id} for the kept ones."""

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, raw: Request) -> Any:
        return await generate("Responses", body, raw, serving.create_response)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        return respond(serving.stored(response_id)[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        if serving.store is None or not serving.store.delete(response_id):
            raise HTTPError(404, f"Response with id {response_id!r} not found.", "response_id")
        return respond({"id": response_id, "object": "response", "deleted": True})
