"""The scheduler's running requests, with the counters every step reads held as arrays.

A decode step touches every running request: how many tokens it wants, whether
its blocks have room, whether the token that came back stops it. Done one
request at a time in Python that costs microseconds per request, which at a
few hundred running requests is most of a step's host time. `RunningBatch`
keeps those counters in numpy arrays beside the requests, so that the
scheduler plans a step and applies its results in a handful of array passes;
Python then only touches the requests whose state really changes (a new block,
a finish, a token appended to its history).

Entry `i` of every array belongs to `requests[i]`, and `requests[i].batch_index
== i`. Two counters that change every step, `computed` and `pending`, live only
here while a request runs: its `num_computed_tokens` and
`num_output_placeholders` read and write these arrays, and get their values
back when it leaves. The rest mirror the request and are written together with
it by the scheduler; `check()` verifies them (tests run it after every step).

`schedule_running` and `apply_sampled` are the scheduler's array path: the same
policy as its per-request code (`Scheduler.vectorized = False`), for the usual
step. tests/core/test_scheduler_paths.py drives random workloads through both
and asserts identical SchedulerOutputs and engine outputs at every step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxllm.core.block_hash import BlockHasher
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.messages import EngineCoreOutput
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import CachedRequestData, SchedulerOutput


@dataclass(frozen=True)
class StepLimits:
    """The scheduler's limits that the array passes apply."""

    block_size: int
    max_model_len: int
    # The most tokens one request can hold in the cache (see Scheduler).
    max_request_tokens: int
    long_prefill_token_threshold: int
    enable_prefix_caching: bool

    def wanted_tokens(self, request: Request, num_computed: int) -> int:
        """Tokens the request would compute this step, before the budget cuts them.

        A token still in flight (async scheduling) counts as known: its id is
        fed to the next step on the device. A request whose in-flight token is
        its last allowed one is not scheduled again. `schedule_running` is
        this rule over the whole batch.
        """
        pending = request.num_output_placeholders
        if pending and (request.num_output_tokens + pending >= request.max_tokens
                        or request.num_tokens + pending >= self.max_request_tokens):
            return 0
        num_new = request.num_tokens + pending - num_computed
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return num_new

    def fit_tokens(self, num_new: int, num_computed: int, token_budget: int) -> int:
        # Never place a token at a position >= max_model_len.
        return max(0, min(num_new, token_budget, self.max_model_len - num_computed))


class RunningPlan(NamedTuple):
    """What `schedule_running` scheduled: requests `[0, stop)` of the batch are done."""

    stop: int
    token_budget: int  # left after them
    num_prompt_tokens: int
    ids: list[str]  # the scheduled ones, in batch order
    counts: np.ndarray  # int32: tokens of each
    samples: np.ndarray  # bool: whether each samples a token
    computed_before: np.ndarray  # int32: computed tokens before the step


class RunningBatch:
    # name -> dtype of each mirrored per-request field.
    FIELDS = {
        "computed": np.int64,  # num_computed_tokens
        "num_tokens": np.int64,  # prompt + known outputs
        "num_output": np.int64,  # known outputs
        "pending": np.int64,  # num_output_placeholders (tokens in flight)
        "max_tokens": np.int64,
        "num_prompt": np.int64,
        "num_blocks": np.int64,  # blocks the KV cache manager holds for it
        "num_cached_blocks": np.int64,  # of those, registered in the prefix cache
        "eos": np.int64,  # the token that stops it, -1 for none (or ignore_eos)
        "min_tokens": np.int64,
        "has_stop_ids": bool,  # stop_token_ids set: checked one by one
        "simple": bool,  # generates tokens (not a pooling request)
    }

    def __init__(self, capacity: int, limits: StepLimits, max_loras: int = 0) -> None:
        self.capacity = capacity
        self.limits = limits
        self.max_loras = max_loras  # distinct LoRA adapters that may run at once
        self.requests: list[Request] = []
        self.ids: list[str] = []
        for name, dtype in self.FIELDS.items():
            setattr(self, name, np.zeros(capacity, dtype))

    # ---------------------------------------------------------------- sequence

    def __len__(self) -> int:
        return len(self.requests)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def active_loras(self) -> set[int]:
        """The distinct LoRA adapters running (at most `max_loras`, the device's adapter
        slots; vLLM caps a batch the same way)."""
        return {r.lora_int_id for r in self.requests if r.lora_int_id}

    def __getitem__(self, i: int) -> Request:
        return self.requests[i]

    # ---------------------------------------------------------------- changes

    def append(self, request: Request, num_blocks: int, num_cached_blocks: int) -> None:
        i = len(self.requests)
        if i >= self.capacity:
            raise RuntimeError("running batch is full: the scheduler exceeded max_num_seqs")
        self.requests.append(request)
        self.ids.append(request.request_id)
        params = request.sampling_params
        self.computed[i] = request.num_computed_tokens
        self.pending[i] = request.num_output_placeholders
        request.batch_index, request._batch = i, self  # the counters now live here
        self.num_tokens[i] = len(request.all_token_ids)
        self.num_output[i] = len(request.output_token_ids)
        self.max_tokens[i] = request.max_tokens
        self.num_prompt[i] = request.num_prompt_tokens
        self.num_blocks[i] = num_blocks
        self.num_cached_blocks[i] = num_cached_blocks
        simple = request.pooling_params is None and params is not None
        self.simple[i] = simple
        eos = request.eos_token_id
        self.eos[i] = -1 if (not simple or params.ignore_eos or eos is None) else eos
        self.min_tokens[i] = params.min_tokens if simple else 0
        self.has_stop_ids[i] = simple and bool(params.stop_token_ids)

    def pop(self) -> Request:
        """Removes and returns the last request (the preemption victim)."""
        self._detach(len(self.requests) - 1)
        self.ids.pop()
        return self.requests.pop()

    def remove(self, indices: list[int]) -> None:
        """Removes the requests at `indices`; the others keep their order."""
        if not indices:
            return
        keep = np.ones(len(self.requests), bool)
        keep[indices] = False
        for i in indices:
            self._detach(i)
        self._permute(np.flatnonzero(keep))

    def _detach(self, i: int) -> None:
        """Gives request `i` its counters back; it no longer reads them here."""
        request = self.requests[i]
        request._num_computed_tokens = int(self.computed[i])
        request._num_output_placeholders = int(self.pending[i])
        request.batch_index, request._batch = -1, None

    def sort(self, key: Callable[[Request], object]) -> None:
        """Stable sort by `key`."""
        order = sorted(range(len(self.requests)), key=lambda i: key(self.requests[i]))
        self._permute(np.asarray(order, np.int64))

    def _permute(self, order: np.ndarray) -> None:
        m, k = len(self.requests), order.size
        for name in self.FIELDS:
            arr = getattr(self, name)
            arr[:k] = arr[:m][order]
        idx = order.tolist()
        self.requests = [self.requests[i] for i in idx]
        self.ids = [self.ids[i] for i in idx]
        for i, request in enumerate(self.requests):
            request.batch_index = i

    # ---------------------------------------------------------------- checks

    def check(self, block_state: Callable[[str], tuple[int, int]]) -> None:
        """Asserts that every mirrored field equals its request's (for tests)."""
        assert len(self.ids) == len(self.requests) <= self.capacity
        for i, r in enumerate(self.requests):
            assert r.batch_index == i and self.ids[i] == r.request_id, (i, r)
            nb, nc = block_state(r.request_id)
            assert r._batch is self
            # Scheduled drafts (speculative decoding) count until their step returns.
            assert 0 <= self.computed[i] <= (len(r.all_token_ids) + self.pending[i]
                                             + len(r.spec_token_ids)), r
            got = (self.num_tokens[i], self.num_output[i], self.num_blocks[i],
                   self.num_cached_blocks[i], self.max_tokens[i], self.num_prompt[i])
            want = (len(r.all_token_ids), len(r.output_token_ids), nb, nc, r.max_tokens,
                    r.num_prompt_tokens)
            assert tuple(int(x) for x in got) == want, (r, got, want)

    # ---------------------------------------------------------------- array path

    def schedule_running(self, token_budget: int, kv: KVCacheManager,
                         cached: CachedRequestData) -> RunningPlan:
        """Schedules the running requests with array passes, in priority order.

        The same decisions as the scheduler's per-request loop. Only requests
        that need a new block (or a newly full block registered in the prefix
        cache) call the KV cache manager. Stops at the first one the pool
        cannot serve, since making room means preempting: the per-request
        loop goes on from `stop`. Appends the scheduled requests to `cached`.
        """
        lim, m = self.limits, len(self.requests)
        bs = lim.block_size
        computed, num_tokens, pending = self.computed[:m], self.num_tokens[:m], self.pending[:m]
        want = num_tokens + pending - computed
        if lim.long_prefill_token_threshold > 0:
            np.minimum(want, lim.long_prefill_token_threshold, out=want)
        # Never place a token at a position >= max_model_len.
        np.minimum(want, lim.max_model_len - computed, out=want)
        # A request whose token in flight is its last allowed one is not scheduled again.
        want[(pending > 0) & ((self.num_output[:m] + pending >= self.max_tokens[:m])
                              | (num_tokens + pending >= lim.max_request_tokens))] = 0
        np.maximum(want, 0, out=want)
        # In priority order until the budget runs out.
        take = np.minimum(want, np.maximum(token_budget - (np.cumsum(want) - want), 0))
        end = computed + take
        need = end > self.num_blocks[:m] * bs
        if lim.enable_prefix_caching:
            # A block to register: full and hashed (the hashes cover the known tokens).
            need |= np.minimum(end, num_tokens) // bs > self.num_cached_blocks[:m]
        need &= take > 0

        need_idx, reqs = np.flatnonzero(need), self.requests
        new_ids, held, registered = kv.extend_running_many(
            [reqs[i] for i in need_idx.tolist()], end[need_idx].tolist())
        served = need_idx[:len(held)]
        stop = m if len(held) == need_idx.size else int(need_idx[len(held)])
        self.num_blocks[served] = held
        self.num_cached_blocks[served] = registered

        sel = np.flatnonzero(take[:stop])
        if sel.size == stop:  # every request up to `stop`: the usual decode step
            ids, idx = self.ids[:stop], range(stop)
        else:
            idx = sel.tolist()
            ids = [self.ids[i] for i in idx]
        # The requests' num_computed_tokens and placeholders are these arrays.
        new_end, old = end[sel], computed[sel]
        samples = new_end >= num_tokens[sel] + pending[sel]
        self.computed[sel] = new_end
        self.pending[sel[samples]] += 1
        cached.req_ids.extend(ids)
        cached.new_block_ids.extend(itertools.repeat((), len(ids)))
        for i, blocks in zip(served.tolist(), new_ids, strict=True):
            if blocks:
                cached.new_block_ids[i if len(ids) == stop else idx.index(i)] = blocks
        num_prompt = self.num_prompt[sel]
        num_prompt_tokens = int(np.maximum(np.minimum(new_end, num_prompt) - old, 0).sum())
        return RunningPlan(stop, token_budget - int(take[:stop].sum()), num_prompt_tokens, ids,
                           take[sel].astype(np.int32), samples, old.astype(np.int32))

    def apply_sampled(self, so: SchedulerOutput, runner: ModelRunnerOutput,
                      requests: dict[str, Request], block_hasher: BlockHasher | None,
                      outputs: list[EngineCoreOutput | None],
                      finished: list[tuple[int, Request]]) -> tuple[list[int], int, tuple]:
        """`Scheduler.update_from_output` for the step's simple requests, with array passes.

        Simple: in the running batch, generating (not pooling), at most one new
        token, and a step without logprobs. Stop conditions are evaluated for
        all of them at once; Python only appends each token to its request's
        history and makes its output. Fills `outputs` and `finished` as the
        per-request path does. Returns the positions left to the per-request
        path, the number of tokens generated and the compact tokens (request
        ids, token ids; see EngineCoreOutputs).
        """
        req_ids = so.req_ids
        n, lim = len(req_ids), self.limits
        if req_ids == self.ids:  # the usual decode step: the whole batch, in its order
            reqs, batch_index = list(self.requests), np.arange(n)
        else:
            reqs = list(map(requests.get, req_ids))
            batch_index = np.array([-1 if r is None else r.batch_index for r in reqs],
                                   np.int64)
        tokens = runner.sampled_array
        if tokens is None:  # -1: no token, -2: more than one (per-request path)
            tokens = np.array([(s[0] if len(s) == 1 else -2) if s else -1
                               for s in runner.sampled_token_ids], np.int64)
        simple = (batch_index >= 0) & (tokens >= -1)
        simple[simple] = self.simple[batch_index[simple]]
        if simple.all():
            pos, ids, rows, tok = list(range(n)), req_ids, batch_index, tokens
        else:
            pos = np.flatnonzero(simple).tolist()
            ids, reqs = [req_ids[j] for j in pos], [reqs[j] for j in pos]
            rows, tok = batch_index[pos], tokens[pos]
        has = tok >= 0
        samples = so.samples if len(ids) == len(req_ids) else so.samples[pos]
        num_output = self.num_output[rows] + has
        num_tokens = self.num_tokens[rows] + has
        reached_min = has & (num_output >= self.min_tokens[rows])
        eos = reached_min & (tok == self.eos[rows])
        status = np.where(eos, int(RequestStatus.FINISHED_STOPPED), 0)
        length = has & ((num_output >= self.max_tokens[rows])
                        | (num_tokens >= lim.max_request_tokens))
        status[length & ~eos] = RequestStatus.FINISHED_LENGTH_CAPPED
        stop_ids = {}
        for k in np.flatnonzero(reached_min & ~eos & self.has_stop_ids[rows]).tolist():
            token = int(tok[k])
            if token in reqs[k].sampling_params.stop_token_ids:
                status[k] = RequestStatus.FINISHED_STOPPED
                stop_ids[k] = token
        self.num_output[rows] = num_output
        self.num_tokens[rows] = num_tokens
        self.pending[rows[samples]] -= 1  # the requests' placeholders

        # Python only where each request must change: its token history.
        tok_list = tok.tolist()
        if has.all():
            got, got_tok = reqs, tok_list
        else:
            keep = has.tolist()
            got, got_tok = (list(itertools.compress(x, keep)) for x in (reqs, tok_list))
        for request, token in zip(got, got_tok, strict=True):
            request.all_token_ids.append(token)  # output_token_ids is a view of it
        # Outputs: a token that is neither its request's first (which reports
        # the prefix-cache hits) nor its last goes out in the compact lists.
        compact = has & (status == 0) & (num_output > 1)
        if compact.all():
            compact_ids, compact_tok = ids, tok_list
        else:
            keep = compact.tolist()
            compact_ids = list(itertools.compress(ids, keep))
            compact_tok = list(itertools.compress(tok_list, keep))
            for k in np.flatnonzero(has & ~compact & (status == 0)).tolist():
                request = reqs[k]  # positional: msgspec takes those fastest
                outputs[pos[k]] = EngineCoreOutput(request.request_id, [tok_list[k]], None,
                                                   None, None, None, None,
                                                   request.num_cached_tokens)
        if block_hasher is not None:  # the blocks these tokens filled
            block_hasher.hash_next_block(
                [reqs[k] for k in np.flatnonzero(has & (num_tokens % lim.block_size == 0))
                 .tolist()])
        for k in np.flatnonzero(status).tolist():
            request = reqs[k]
            request.status = RequestStatus(int(status[k]))
            if k in stop_ids:
                request.stop_reason = stop_ids[k]
            outputs[pos[k]] = EngineCoreOutput(
                request.request_id, [tok_list[k]], finish_reason=request.status.finish_reason(),
                stop_reason=request.stop_reason,
                num_cached_tokens=max(0, request.num_cached_tokens))
            finished.append((pos[k], request))
        return np.flatnonzero(~simple).tolist(), int(has.sum()), (compact_ids, compact_tok)
