"""EngineCoreOutputs -> RequestOutputs: detokenize, stop strings, logprobs, n > 1.

A request with n > 1 is fanned out by the frontend into n child requests in
the core (they share the prompt's KV blocks through the prefix cache); this
processor gathers the children back into one RequestOutput.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from jaxllm.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from jaxllm.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    """The user's request; its n children run in the core under ids `{i}_{request_id}`."""

    request_id: str
    n: int
    output_kind: RequestOutputKind
    children: dict[int, RequestState] = field(default_factory=dict)
    queue: Any = None  # where AsyncLLM collects outputs; None -> returned to the caller

    @property
    def finished(self) -> bool:
        if self.n == 1:
            child = self.children.get(0)
            return child is not None and child.finish_reason is not None
        return len(self.children) == self.n and all(c.finished for c in self.children.values())

    @property
    def first(self) -> RequestState:
        return self.children[0] if 0 in self.children else self.children[min(self.children)]


@dataclass
class RequestState:
    request_id: str  # the id in the engine core
    parent: ParentRequest
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    request: EngineCoreRequest
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    sent_tokens: int = 0  # token ids already returned as deltas
    sent_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    # Requests finished here (stop strings) that the core must abort.
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def add_request(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest,
                    index: int) -> None:
        params = request.sampling_params
        detok = None
        if params is not None and params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params, request.prompt_token_ids)
        state = RequestState(
            request_id=request.request_id, parent=parent, index=index, prompt=prompt,
            prompt_token_ids=request.prompt_token_ids, request=request, detokenizer=detok,
            logprobs=[] if params is not None and params.logprobs is not None else None,
            cumulative_logprob=0.0 if params is not None and params.logprobs is not None
            else None,
            arrival_time=request.arrival_time)
        parent.children[index] = state
        self.parents[parent.request_id] = parent
        self.request_states[request.request_id] = state

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Drops parents (user ids) or children (core ids); returns the core ids dropped."""
        core_ids: list[str] = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                for child in parent.children.values():
                    if self.request_states.pop(child.request_id, None) is not None:
                        core_ids.append(child.request_id)
            elif self.request_states.pop(rid, None) is not None:
                core_ids.append(rid)
        return core_ids

    def process_outputs(self, outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        results: list[RequestOutput | PoolingRequestOutput] = []
        to_abort: list[str] = []
        now = time.time()
        for out in outputs.all_outputs():
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            if out.pooling_output is not None:
                self._finish(state)
                po = PoolingRequestOutput(state.parent.request_id, state.prompt_token_ids,
                                          PoolingOutput(out.pooling_output))
                if state.parent.queue is not None:
                    state.parent.queue.put(po)
                else:
                    results.append(po)
                continue
            if state.first_token_time is None and out.new_token_ids:
                state.first_token_time = now
            if out.new_token_ids:
                state.last_token_time = now
            if out.num_cached_tokens >= 0:  # -1: unchanged (compact tokens)
                state.num_cached_tokens = out.num_cached_tokens
            self._update(state, out)
            if state.finished and out.finish_reason is None:
                to_abort.append(state.request_id)  # a stop string: the core still runs it
            if state.finished:
                self._finish(state)
            ro = self._make_output(state)
            if ro is None:
                continue
            if state.parent.queue is not None:
                state.parent.queue.put(ro)
            else:
                results.append(ro)
        return OutputProcessorOutput(results, to_abort)

    def _update(self, state: RequestState, out: EngineCoreOutput) -> None:
        new_ids = out.new_token_ids
        stop_str = None
        new_logprobs = out.new_logprobs
        if state.detokenizer is not None and new_ids:
            text_ids = new_ids
            if out.finish_reason == FinishReason.STOP and not state.detokenizer.include_stop:
                # The EOS or stop token that ended the request is not part of the text,
                # as in vLLM (it shows with skip_special_tokens=False otherwise).
                text_ids = new_ids[:-1]
            stop_str = state.detokenizer.update(text_ids) if text_ids else None
            if stop_str is not None and state.detokenizer.consumed < len(new_ids):
                # Tokens after the one that completed a stop string are dropped (a step
                # may emit several: speculative decoding).
                new_ids = new_ids[:state.detokenizer.consumed]
                if new_logprobs is not None:
                    new_logprobs = new_logprobs.slice(0, len(new_ids))
        state.token_ids.extend(new_ids)
        if new_logprobs is not None and state.logprobs is not None:
            self._append_logprobs(state, new_logprobs)
        if out.new_prompt_logprobs is not None:
            k = state.request.sampling_params.prompt_logprobs or 0
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None]
            state.prompt_logprobs.extend(self._to_dicts(out.new_prompt_logprobs, k))
        if stop_str is not None:
            state.finish_reason, state.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            state.finish_reason = str(out.finish_reason)
            state.stop_reason = out.stop_reason

    def _append_logprobs(self, state: RequestState, lp: LogprobsLists) -> None:
        k = state.request.sampling_params.logprobs or 0
        dicts = self._to_dicts(lp, k)
        state.logprobs.extend(dicts)
        for row in lp.logprobs:
            state.cumulative_logprob += row[0]

    def _to_dicts(self, lp: LogprobsLists, k: int) -> list[dict[int, Logprob]]:
        out = []
        for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True):
            d = {ids[0]: Logprob(lps[0], rank, self._decode(ids[0]))}
            for j in range(1, min(k, len(ids) - 1) + 1):
                d.setdefault(ids[j], Logprob(lps[j], j, self._decode(ids[j])))
            out.append(d)
        return out

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one processor per engine, bounded
    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _finish(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
        if state.parent.finished:
            self.parents.pop(state.parent.request_id, None)

    def _completion(self, state: RequestState, delta: bool) -> CompletionOutput:
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.get_next_output_text(state.finished, delta)
        # Slices are copies: the state's lists keep growing after this output.
        logprobs = state.logprobs
        if delta:
            ids = state.token_ids[state.sent_tokens:]
            state.sent_tokens += len(ids)
            if logprobs is not None:
                logprobs = logprobs[state.sent_logprobs:]
                state.sent_logprobs += len(logprobs)
        else:
            ids = state.token_ids[:]
            if logprobs is not None:
                logprobs = logprobs[:]
        return CompletionOutput(state.index, text, ids, state.cumulative_logprob, logprobs,
                                state.finish_reason, state.stop_reason)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        parent = state.parent
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not parent.finished:
                return None
            children = [parent.children[i] for i in sorted(parent.children)]
            completions = [self._completion(c, delta=False) for c in children]
        elif kind == RequestOutputKind.DELTA:
            completions = [self._completion(state, delta=True)]
        else:
            children = [parent.children[i] for i in sorted(parent.children)]
            completions = [self._completion(c, delta=False) for c in children]
        first = state if parent.n == 1 else parent.first
        metrics = {"arrival_time": first.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if state.last_token_time is not None:
            metrics["last_token_time"] = state.last_token_time
        return RequestOutput(
            request_id=parent.request_id, prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids, prompt_logprobs=first.prompt_logprobs,
            outputs=completions, finished=parent.finished,
            num_cached_tokens=first.num_cached_tokens, metrics=metrics)


FINISH_REASONS = {r: str(r) for r in FinishReason}
