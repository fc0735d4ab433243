"""Continuous-batching scheduler: which requests run each step, and for how many tokens.

Each step has a token budget (`max_num_batched_tokens`) and a request cap
(`max_num_seqs`). Running requests are served first, in priority order, then
waiting requests are admitted; a prompt that does not fit the remaining budget
is cut into chunks (chunked prefill). When the cache runs out of blocks the
lowest-priority, latest-arrived running request is preempted: its blocks are
freed and it is recomputed later. At most `max_loras` distinct LoRA adapters run
at once; a waiting request whose adapter has no free slot is passed over, keeping
its place, and later ones are admitted (as vLLM). `update_from_output` appends the sampled
tokens, applies stop conditions and turns the step into EngineCoreOutputs.

The running requests form a RunningBatch whose per-step counters are arrays:
the usual step (decodes and chunks that find their blocks) is planned and
applied by its array passes (`schedule_running`, `apply_sampled`); the code
here handles what is left (preemption, admission, pooling, logprobs) one
request at a time and, with `vectorized = False`, every step: the reference
that tests/core/test_scheduler_paths.py compares the array path with.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from operator import itemgetter

import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.core.block_hash import make_block_hasher
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.request_queue import SchedulingPolicy, create_request_queue
from jaxllm.core.request_update import update_request
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.running_batch import RunningBatch, StepLimits
from jaxllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.core.spec_schedule import DraftPlanner
from jaxllm.kv_groups import max_request_tokens

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        sched, cache = config.scheduler_config, config.cache_config
        if cache.num_blocks < 2:
            raise ValueError(f"cache_config.num_blocks must be at least 2 (block 0 is "
                             f"reserved), got {cache.num_blocks}; size the cache first")
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.max_model_len = config.model_config.max_model_len
        self.policy = SchedulingPolicy(sched.policy)
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        self.enable_prefix_caching = cache.enable_prefix_caching

        self.kv_cache_manager = KVCacheManager(cache.num_blocks, cache.block_size,
                                               cache.enable_prefix_caching,
                                               tuple(cache.group_windows),
                                               use_eagle=config.eagle_head is not None)
        self._block_hasher = make_block_hasher(cache.block_size) \
            if cache.enable_prefix_caching else None

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        # The most tokens one request can ever hold in the cache. The engine
        # rejects at entry a prompt longer than this; a running request is
        # length-capped on reaching it, so it can always progress.
        self.max_request_tokens = max_request_tokens(
            cache.group_windows, self.num_blocks - 1, self.block_size,
            self.max_num_batched_tokens, self.max_model_len)
        self.limits = StepLimits(self.block_size, self.max_model_len, self.max_request_tokens,
                                 self.long_prefill_token_threshold, self.enable_prefix_caching)
        self.running = RunningBatch(self.max_num_seqs, self.limits,
                                    config.lora_config.max_loras if config.lora_config else 0)
        # Plan steps and apply their results with array passes over the running
        # batch (off: one request at a time, the reference the tests compare with).
        self.vectorized = config.speculative_config is None
        # Speculative decoding (spec_schedule.py) takes the per-request path: the
        # array path plans one token per request.
        spec = config.speculative_config
        self.spec = spec and DraftPlanner(spec.num_speculative_tokens, self.max_request_tokens)
        # Verify the running batch's arrays against the requests after every
        # schedule and update (tests set JAXLLM_CHECK_INVARIANTS=1).
        self.check_invariants = os.environ.get("JAXLLM_CHECK_INVARIANTS") == "1"
        # Ids finished (or aborted) since the last schedule(): the runner drops them.
        self.finished_req_ids: set[str] = set()

        self.num_preemptions = 0
        self._last_num_prompt_tokens = 0
        self._last_num_generation_tokens = 0

        # Whether `running` may be out of priority order (set when a request
        # that sorts before the last one joins it).
        self._running_unsorted = False

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.max_request_tokens:
            # The engine rejects these at entry; admitting one would stall the
            # queue forever, since it can never get enough blocks.
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens, "
                             f"more than one request can hold ({self.max_request_tokens})")
        if self._block_hasher is not None and not request.has_block_hasher:
            request.attach_block_hasher(self._block_hasher)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Ends requests from outside the step (abort, error); unknown ids are ignored."""
        if not finished_status.is_finished():
            raise ValueError(f"{finished_status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        to_finish = [self.requests[r] for r in dict.fromkeys(request_ids) if r in self.requests]
        self.running.remove([r.batch_index for r in to_finish
                             if r.status == RequestStatus.RUNNING])
        self.waiting.remove_many(r for r in to_finish if r.status != RequestStatus.RUNNING)
        for request in to_finish:
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---------------------------------------------------------------- schedule

    def _priority_key(self, request: Request) -> tuple[float, ...]:
        if self.policy is SchedulingPolicy.PRIORITY:
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        # Every step that computed these tokens was dispatched, and its prompt
        # logprobs reach the output (position p scores prompt token p + 1).
        request.prompt_logprobs_from = max(request.prompt_logprobs_from, min(
            request.num_computed_tokens, request.num_prompt_tokens - 1))
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        cached = CachedRequestData()
        scheduled_new: list[NewRequestData] = []
        preempted: list[Request] = []
        # The step's requests, tokens and whether each samples: the array pass
        # gives the first part, the loops below append one request at a time.
        ids: list[str] = []
        counts, samples, computed_before = (np.zeros(0, np.int32), np.zeros(0, bool),
                                            np.zeros(0, np.int32))
        more_counts: list[int] = []
        more_samples: list[bool] = []
        more_computed: list[int] = []

        def scheduled(request: Request, num_new: int, after: int) -> None:
            """Lists a request the loops scheduled; a step that reaches its end samples."""
            ids.append(request.request_id)
            more_counts.append(num_new)
            samples_now = after >= request.num_tokens + request.num_output_placeholders
            more_samples.append(samples_now)
            if samples_now:
                request.num_output_placeholders += 1

        kv = self.kv_cache_manager
        spec_tokens: dict[str, list[int]] = {}

        # Running requests in priority order, so the preemption victim, always
        # the last of the batch, is the lowest-priority, latest-arrived one and
        # has not been scheduled in this step yet (its blocks hold only
        # computed KV when they return to the cache). The sort is stable.
        running = self.running
        if self._running_unsorted:
            running.sort(self._priority_key)
            self._running_unsorted = False
        i, num_prompt_tokens = 0, 0
        drafting = self.spec and self.spec.allowed(running, self.waiting.peek()
                                                   if self.waiting else None)
        if self.vectorized and running:
            (i, token_budget, num_prompt_tokens, ids, counts, samples,
             computed_before) = running.schedule_running(token_budget, kv, cached)
        # One request at a time from `i` on: everything when not vectorized,
        # else from the first request whose blocks the pool could not supply,
        # since finding room means preempting.
        while i < len(running) and token_budget > 0:
            request = running[i]
            num_new = self.limits.wanted_tokens(request, request.num_computed_tokens)
            drafts = (self.spec.drafts(request) if drafting and num_new == 1
                      and request.num_output_placeholders == 0 else ())
            num_new = self.limits.fit_tokens(num_new + len(drafts), request.num_computed_tokens,
                                             token_budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the current request itself was preempted; nothing below fits
            if num_new > 1 and drafts:
                spec_tokens[request.request_id] = list(drafts[:num_new - 1])
            req_id, computed = request.request_id, request.num_computed_tokens
            running.num_blocks[i], running.num_cached_blocks[i] = kv.block_state(req_id)
            cached.req_ids.append(req_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
            more_computed.append(computed)
            token_budget -= num_new
            request.num_computed_tokens = after = computed + num_new
            if computed < request.num_prompt_tokens:
                num_prompt_tokens += min(after, request.num_prompt_tokens) - computed
            scheduled(request, num_new, after)
            i += 1

        # Admit waiting requests, unless this step had to preempt: the cache is
        # full, and a preempted request must not come straight back.
        skipped: list[Request] = []
        loras = running.active_loras() if running.max_loras and self.waiting else set()
        while not preempted and self.waiting and token_budget > 0:
            request = self.waiting.peek()
            if len(running) >= self.max_num_seqs:
                break
            lora = request.lora_int_id
            if lora and lora not in loras and len(loras) >= running.max_loras:
                # As vLLM: its adapter finds no free slot, so it keeps its place in the
                # queue while later requests whose adapters fit (or that have none) run.
                skipped.append(self.waiting.pop())
                continue
            if spec_tokens and not DraftPlanner.allowed((), request):
                break  # it waits for a step without drafts
            hit_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = self.limits.wanted_tokens(request, num_computed)
            # Without chunked prefill a prompt waits for a step with room for
            # all of it, unless no step ever has room: then chunking is the
            # only way it can run (the engine would otherwise spin forever).
            if (not self.enable_chunked_prefill and token_budget < num_new
                    <= self.max_num_batched_tokens):
                break
            num_new = self.limits.fit_tokens(num_new, num_computed, token_budget)
            if num_new == 0:
                break
            new_blocks = kv.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                break
            self.waiting.pop()
            if running and self._priority_key(request) < self._priority_key(running[-1]):
                self._running_unsorted = True
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            scheduled_new.append(NewRequestData.from_request(
                request, self.kv_cache_manager.get_block_ids(request.request_id)))
            req_id = request.request_id
            token_budget -= num_new
            request.num_computed_tokens = after = num_computed + num_new
            num_prompt_tokens += max(0, min(after, request.num_prompt_tokens) - num_computed)
            scheduled(request, num_new, after)
            running.append(request, *kv.block_state(req_id))
            if lora:
                loras.add(lora)
        for request in reversed(skipped):
            self.waiting.prepend(request)

        if more_counts:
            counts = np.concatenate([counts, np.array(more_counts, np.int32)])
            samples = np.concatenate([samples, np.array(more_samples, bool)])
        cached.num_computed_tokens = (np.concatenate([computed_before,
                                                      np.array(more_computed, np.int32)])
                                      if more_computed else computed_before)
        output = SchedulerOutput(
            scheduled_new_reqs=scheduled_new, scheduled_cached_reqs=cached, req_ids=ids,
            num_tokens=counts, samples=samples,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=spec_tokens)
        self.finished_req_ids = set()
        self._last_num_prompt_tokens = num_prompt_tokens
        if self.check_invariants:
            running.check(kv.block_state)
        return output

    # ------------------------------------------------------------------ update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        runner = model_runner_output
        req_ids = scheduler_output.req_ids
        outputs: list[EngineCoreOutput | None] = [None] * len(req_ids)
        finished: list[tuple[int, Request]] = []  # (position in the step, request)
        rest: Iterable[int] = range(len(req_ids))
        num_generated = 0
        compact: tuple[list[str], list[int]] | tuple[None, None] = (None, None)
        if (self.vectorized and req_ids and runner.req_ids == req_ids
                and runner.logprobs is None and not runner.prompt_logprobs
                and not runner.pooler_output):
            rest, num_generated, compact = self.running.apply_sampled(
                scheduler_output, runner, self.requests, self._block_hasher, outputs, finished)
        for j in rest:
            try:
                num_generated += update_request(self, j, req_ids[j], scheduler_output, runner,
                                                outputs, finished)
            except Exception:  # one request's failure ends that request, never the core
                logger.exception("request %s failed in the scheduler's update", req_ids[j])
                request = self.requests[req_ids[j]]
                request.status = RequestStatus.FINISHED_ERROR
                outputs[j] = EngineCoreOutput(request_id=req_ids[j], new_token_ids=[],
                                              finish_reason=request.status.finish_reason())
                if all(r is not request for _, r in finished):
                    finished.append((j, request))

        if finished:
            finished.sort(key=itemgetter(0))
            gone = [r.batch_index for _, r in finished if r.batch_index >= 0]
            if len(gone) < len(finished):
                # Preempted while its step ran, so queued to resume: the token
                # that came back finished it, and it leaves the queue too.
                self.waiting.remove_many(r for _, r in finished if r.batch_index < 0)
            self.running.remove(gone)
            for _, request in finished:
                self._free_request(request)
        self._last_num_generation_tokens = num_generated
        if self.check_invariants:
            self.running.check(self.kv_cache_manager.block_state)
        return EngineCoreOutputs(outputs=[o for o in outputs if o is not None],
                                 scheduler_stats=self.make_stats(), timestamp=time.time(),
                                 token_req_ids=compact[0] or None, token_ids=compact[1] or None)

    # ------------------------------------------------------------------- stats

    def make_stats(self) -> SchedulerStats:
        cache_stats = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=cache_stats.queries, prefix_cache_hits=cache_stats.hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self._last_num_prompt_tokens,
            num_generation_tokens=self._last_num_generation_tokens,
            spec_decoding_stats=self.spec and self.spec.take_stats())

