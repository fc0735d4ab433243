"""What the scheduler hands the model runner each step: the only currency between them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxllm.sampling_params import PoolingParams, SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Non-empty only for a request resumed after preemption: the tokens it had
    # already generated (they are recomputed as part of its "prompt").
    output_token_ids: list[int]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    block_ids: list[int]
    num_computed_tokens: int
    # Prompt positions whose prompt logprobs were already scored before a preemption.
    prompt_logprobs_from: int = 0


@dataclass
class CachedRequestData:
    """Requests the runner already holds; only what changed is sent."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended this step, per request (an empty sequence for most).
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to compute this step (prefill chunk or 1 decode token).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted/preempted since the last step:
    # the runner drops their rows.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests whose scheduled tokens reach their end, so the step samples a
    # token for them (each holds one output placeholder until it arrives).
    sampling_req_ids: set[str] = field(default_factory=set)

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, set())
