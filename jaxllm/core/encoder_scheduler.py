"""The scheduler of an encoder-only model: each request runs its whole prompt in one step.

An encoder keeps no KV cache, so its requests hold no blocks, are never
chunked, preempted or resumed, and have no prefix to share. A step admits
waiting requests in queue order while their whole prompts fit its token
budget and the request cap; each then waits for its pooled output, which
`Scheduler.update_from_output` turns into the request's finish.
"""

from __future__ import annotations

import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.core.request import RequestStatus
from jaxllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.core.scheduler import Scheduler


class EncoderScheduler(Scheduler):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # No KV: the longest request is bounded by the context and one step's budget
        # (the engine arguments make the budget cover max_model_len).
        self.max_request_tokens = min(self.max_model_len, self.max_num_batched_tokens)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        new: list[NewRequestData] = []
        ids: list[str] = []
        counts: list[int] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            n = request.num_tokens
            if n > budget:
                break  # whole prompts only: it waits for a step with room for all of it
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_cached_tokens = 0
            new.append(NewRequestData.from_request(request, []))
            request.num_computed_tokens = n
            request.num_output_placeholders = 1  # its pooled output, awaited
            self.running.append(request, 0, 0)
            ids.append(request.request_id)
            counts.append(n)
            budget -= n
        output = SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(), req_ids=ids,
            num_tokens=np.array(counts, np.int32), samples=np.ones(len(ids), bool),
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        self._last_num_prompt_tokens = sum(counts)
        if self.check_invariants:
            self.running.check(self.kv_cache_manager.block_state)
        return output
