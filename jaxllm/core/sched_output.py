"""What the scheduler hands the model runner each step: the only currency between them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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

    @classmethod
    def from_request(cls, request: Any, block_ids: list[int]) -> NewRequestData:
        """What the runner needs of a scheduler `Request` holding `block_ids`."""
        return cls(
            req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params, pooling_params=request.pooling_params,
            block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
            prompt_logprobs_from=request.prompt_logprobs_from)


@dataclass
class CachedRequestData:
    """Requests the runner already holds; only what changed is sent."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended this step, per request (an empty sequence for most).
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    # [len(req_ids)] int32: each request's computed tokens before this step.
    num_computed_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # The step's requests in the order the runner lays out their tokens, with
    # arrays aligned to them: the tokens each computes this step (a prefill
    # chunk or 1 decode token), and whether those reach its end, so that the
    # step samples a token for it (it holds one output placeholder until the
    # token arrives). The dict view below is built on first use.
    req_ids: list[str]
    num_tokens: np.ndarray  # int32
    samples: np.ndarray  # bool
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted/preempted since the last step:
    # the runner drops their rows.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # [len(req_ids), ceil(vocab / 32)] int32, packed allowed-token bits per
    # request (row j for req_ids[j], all ones when unconstrained); None when no
    # request of the step is constrained (structured_output/manager.py).
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: the draft tokens scheduled after each request's last
    # known token (they are the last of its `num_tokens`); only requests with drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @functools.cached_property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """req_id -> tokens to compute this step."""
        return dict(zip(self.req_ids, self.num_tokens.tolist(), strict=True))
