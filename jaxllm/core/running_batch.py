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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from jaxllm.core.request import Request


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

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
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
            assert 0 <= self.computed[i] <= len(r.all_token_ids) + self.pending[i], r
            got = (self.num_tokens[i], self.num_output[i], self.num_blocks[i],
                   self.num_cached_blocks[i], self.max_tokens[i], self.num_prompt[i])
            want = (len(r.all_token_ids), len(r.output_token_ids), nb, nc, r.max_tokens,
                    r.num_prompt_tokens)
            assert tuple(int(x) for x in got) == want, (r, got, want)
