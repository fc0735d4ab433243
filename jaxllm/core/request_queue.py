"""The scheduler's waiting queue: first-come-first-served or by priority, one interface."""

from __future__ import annotations

import enum
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from jaxllm.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """Waiting requests in the order the scheduler should admit them."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queues a new request in policy order."""

    @abstractmethod
    def pop(self) -> Request:
        """Removes and returns the next request to admit."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit, left in the queue."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Puts a preempted request back ahead of the requests it ties with."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Removes one request (ValueError if absent)."""

    @abstractmethod
    def remove_many(self, requests: Iterable[Request]) -> None:
        """Removes every listed request that is queued; others are ignored."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go back to the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek into an empty request queue")
        return self._queue[0]

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest `priority` value first, then earliest arrival, then queue order.

    A prepended request gets a negative sequence number so that it goes ahead
    of requests with the same priority and arrival time, as in the FCFS queue.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def _push(self, request: Request, seq: int) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    def add(self, request: Request) -> None:
        self._push(request, next(self._seq))

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[3]

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek into an empty request queue")
        return self._heap[0][3]

    def prepend(self, request: Request) -> None:
        self._push(request, -next(self._seq) - 1)

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request.request_id!r} is not in the queue")

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._heap = [e for e in self._heap if id(e[3]) not in drop]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
