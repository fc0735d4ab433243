"""The scheduler's part of speculative decoding: which drafts a step may run, the rollback
of rejected ones, and the acceptance counts.

A decoding request holds the drafts the runner proposed after its last step
(`Request.spec_token_ids`); the scheduler schedules them after its last token
(k + 1 tokens) and, once the step returns, takes the rejected ones back off
its computed tokens: their KV slots are simply overwritten later.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxllm.core.messages import SpecDecodingStats
from jaxllm.core.request import Request


class DraftPlanner:
    def __init__(self, num_spec_tokens: int, max_request_tokens: int):
        self.num_spec_tokens = num_spec_tokens
        self.max_request_tokens = max_request_tokens
        self._stats: SpecDecodingStats | None = None

    @staticmethod
    def allowed(running: Iterable[Request], waiting_head: Request | None) -> bool:
        """Whether a step may schedule drafts: not while a request scores prompt
        logprobs (the verify forward gives no per-token states), nor while the next to
        admit would (it is admitted in a step without drafts, so it never starves)."""
        def scores_prompt(r: Request) -> bool:
            params = r.sampling_params
            return (params is not None and params.prompt_logprobs is not None
                    and r.num_computed_tokens < r.num_prompt_tokens)
        return not any(map(scores_prompt, running)) and (
            waiting_head is None or not scores_prompt(waiting_head))

    def drafts(self, request: Request) -> list[int]:
        """The request's drafts that may run now: none past max_tokens or past what the
        cache can ever hold for it."""
        room = min(self.num_spec_tokens, request.max_tokens - request.num_output_tokens - 1,
                   self.max_request_tokens - request.num_tokens)
        return request.spec_token_ids[:max(room, 0)]

    def verified(self, request: Request, drafts: Sequence[int], emitted: Sequence[int]) -> None:
        """A step verified `drafts` and emitted the accepted ones plus one token: the
        rejected drafts' KV is not the context. (The last emitted token has no KV yet,
        as after any step.)"""
        request.num_computed_tokens -= len(drafts) + 1 - len(emitted)
        stats = self._stats
        if stats is None:
            stats = self._stats = SpecDecodingStats(
                num_spec_tokens=self.num_spec_tokens,
                num_accepted_tokens_per_pos=[0] * self.num_spec_tokens)
        accepted = len(emitted) - 1
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += accepted
        for pos in range(accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1

    def take_stats(self) -> SpecDecodingStats | None:
        """The counts since the last call (each step's go out once)."""
        stats, self._stats = self._stats, None
        return stats
