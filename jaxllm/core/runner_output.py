"""What the model runner returns each step (host numpy/lists only)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from jaxllm.sample.logprobs import LogprobsLists


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request: the sampled token, or [] for a prompt chunk that
    # does not reach the end of the prompt (nothing is sampled for it). None
    # when `sampled_array` holds them all (see `tokens_of`).
    sampled_token_ids: list[list[int]] | None
    # Row i belongs to req_ids[i]; only when some request asked for logprobs.
    logprobs: LogprobsLists | None = None
    # Prompt logprobs of the positions computed this step, per request.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Pooled hidden states for pooling requests that finished their prompt.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # sampled_token_ids as one array where each request got at most one
    # token (-1: none), so the scheduler need not walk the lists; optional.
    sampled_array: np.ndarray | None = None
    # Speculative decoding: where each request's rows start in `logprobs` (None: row
    # i), and its drafts for the next step (one list per request, maybe empty).
    logprob_rows: list[int] | None = None
    spec_token_ids: list[list[int]] | None = None

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls([], [])

    @cached_property
    def req_id_to_index(self) -> dict[str, int]:
        """Position of each request in `req_ids`; built on first use (a decode step
        of the whole batch in order never asks)."""
        return {r: i for i, r in enumerate(self.req_ids)}

    def tokens_of(self, index: int) -> Sequence[int]:
        """The tokens sampled for request `index` of this step."""
        if self.sampled_token_ids is not None:
            return self.sampled_token_ids[index]
        token = int(self.sampled_array[index])
        return (token,) if token >= 0 else ()
