"""Messages between the frontend and the engine core (msgspec, so they cross ZMQ cheaply).

They live in core, beside the scheduler that makes them, so that the scheduler
and the worker import them without reaching up into engine/."""

from __future__ import annotations

import enum
import itertools

import msgspec

from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sampling_params import PoolingParams, SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0


# The per-step messages are made by the hundred every step and can hold no
# reference cycle (they hold lists of numbers and each other, never themselves):
# gc=False keeps them out of the cyclic collector's generations.


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True,  # type: ignore[call-arg]
                       gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    pooling_output: list[float] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, gc=False):  # type: ignore[call-arg]
    """One step's speculative decoding, under vLLM's names."""

    num_spec_tokens: int = 0  # drafts a request may get per step (k)
    num_drafts: int = 0  # requests that had drafts verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []  # [k]: accepted at draft position i


class SchedulerStats(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # scheduled this step
    num_generation_tokens: int = 0  # sampled this step
    spec_decoding_stats: SpecDecodingStats | None = None  # this step's, when speculating


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Ids that finished inside the core without an output for them (aborts).
    finished_requests: list[str] | None = None
    # Set on a fatal error: the core is going away.
    engine_error: str | None = None
    # The common case in compact form: one new token for each of these requests
    # and nothing else (not finished, no logprobs, not their first token). The
    # core sends two lists instead of one output object per request; readers
    # take `all_outputs()`, which makes the objects on their side.
    token_req_ids: list[str] | None = None
    token_ids: list[int] | None = None
    # Which data-parallel engine core sent these (set by the frontend as they arrive).
    engine_index: int = 0

    def all_outputs(self) -> list[EngineCoreOutput]:
        """`outputs` plus one EngineCoreOutput per compact token (made once, in place)."""
        if self.token_req_ids:
            self.outputs.extend(map(EngineCoreOutput, self.token_req_ids,
                                    map(list, zip(self.token_ids)), *_UNSET_FIELDS))
        self.token_req_ids = self.token_ids = None
        return self.outputs


# EngineCoreOutput's fields after the token ids for a compact token: nothing, and
# num_cached_tokens -1 ("as reported with the request's first token").
_UNSET_FIELDS = (*(itertools.repeat(None) for _ in range(5)), itertools.repeat(-1))
