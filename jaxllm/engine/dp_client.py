"""Data parallelism: one frontend over N engine cores (vLLM's DP clients).

Each core is a full replica on its own `tensor_parallel_size` devices
(distributed/dp_devices.py), in its own process behind its own `MPClient`.
The DP client starts them together, sends each new request to the least
loaded core, remembers which core holds which request (so that an abort goes
there), broadcasts utility calls, and reads every core's outputs from one
queue; each EngineCoreOutputs names its core (`engine_index`), which the
stat loggers use as the `engine` label. The death of any core is the
engine's death: the frontend fails what is in flight and the server's
supervisor replaces all N cores.

Load balancing counts, in the frontend, the unfinished requests of each core,
updated as a request is sent, and as its core reports it finished or the
frontend aborts it; the least loaded core gets the next request (ties rotate,
so that a stream of one request at a time still spreads). vLLM's coordinator
weighs the cores' own `4 * waiting + running`, but those counts only arrive
with a core's step outputs and lag a burst of arrivals; with one frontend its
own count is exact the moment it decides, and equals waiting + running.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from jaxllm.config import EngineConfig
from jaxllm.core.messages import EngineCoreOutputs, EngineCoreRequest
from jaxllm.distributed.dp_devices import CorePlacement, core_placements
from jaxllm.engine.core_client import (
    AsyncMPClient,
    EngineCoreClient,
    MPClient,
    SyncMPClient,
    read_output,
)
from jaxllm.errors import EngineDeadError


class LoadBalancer:
    """Which core holds each unfinished request, and how many each holds."""

    def __init__(self, num_engines: int):
        self.counts = [0] * num_engines
        self.owner: dict[str, int] = {}
        self._next = 0
        self._lock = threading.Lock()  # the sync client's reader threads release too

    def assign(self, request_id: str) -> int:
        """The least loaded core (ties: the next in turn) now holds `request_id`."""
        with self._lock:
            n = len(self.counts)
            least = min(self.counts)
            engine = next(e for e in ((self._next + k) % n for k in range(n))
                          if self.counts[e] == least)
            self._next = (engine + 1) % n
            self.owner[request_id] = engine
            self.counts[engine] += 1
            return engine

    def release(self, request_ids: list[str], engine: int | None = None) -> dict[int, list[str]]:
        """Forgets the requests (of `engine` only, where given); returns them by core."""
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                e = self.owner.get(rid)
                if e is None or (engine is not None and e != engine):
                    continue
                del self.owner[rid]
                self.counts[e] -= 1
                by_engine.setdefault(e, []).append(rid)
        return by_engine

    def observe(self, outputs: EngineCoreOutputs) -> None:
        """Releases the requests that `outputs` reports finished by their core."""
        done = [o.request_id for o in outputs.outputs if o.finish_reason is not None]
        done.extend(outputs.finished_requests or ())
        if done:
            self.release(done, outputs.engine_index)


class _DPClient(EngineCoreClient):
    clients: list

    def _start(self, make: Callable[[CorePlacement], MPClient], data_parallel_size: int,
               tensor_parallel_size: int) -> None:
        """Starts the N cores at once; if any fails, stops the others and raises."""
        dp = data_parallel_size
        placements = core_placements(dp, tensor_parallel_size)
        with ThreadPoolExecutor(dp, thread_name_prefix="dp-launch") as pool:
            futures = [pool.submit(make, p) for p in placements]
            clients, error = [], None
            for f in futures:
                try:
                    clients.append(f.result())
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    error = error or e
        if error is not None:
            for c in clients:
                c.shutdown()
            raise error
        self.clients = clients
        self.max_request_tokens = min(c.max_request_tokens for c in clients)
        self.num_blocks = min(c.num_blocks for c in clients)
        self.balancer = LoadBalancer(dp)

    def add_request(self, request: EngineCoreRequest) -> None:
        engine = self.balancer.assign(request.request_id)
        try:
            self.clients[engine].add_request(request)
        except BaseException:
            self.balancer.release([request.request_id])
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, ids in self.balancer.release(list(request_ids)).items():
            self.clients[engine].abort_requests(ids)

    @property
    def engine_dead(self) -> bool:
        return any(c.engine_dead for c in self.clients)

    def dead_error(self) -> EngineDeadError:
        dead = [c for c in self.clients if c.engine_dead or not c.is_alive()]
        if not dead:
            return self.clients[0].dead_error()
        c = dead[0]
        return EngineDeadError(f"engine core {c.engine_index}: "
                               f"{c.engine_error or 'the engine core is not running'}")

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.clients)

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.clients]

    def shutdown(self) -> None:
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="dp-stop") as pool:
            list(pool.map(lambda c: c.shutdown(), self.clients))


class DPSyncMPClient(_DPClient):
    """Blocking DP client for LLMEngine (offline `LLM(data_parallel_size=N)`)."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float | None = None):
        pc = config.parallel_config
        self._outputs: queue.Queue = queue.Queue()
        self._start(lambda p: SyncMPClient(config, startup_timeout_s, placement=p,
                                           outputs=self._outputs),
                    pc.data_parallel_size, pc.tensor_parallel_size)

    def get_output(self) -> EngineCoreOutputs:
        item = read_output(self._outputs, self.engine_dead, self.dead_error)
        self.balancer.observe(item)
        return item

    def reset_prefix_cache(self) -> bool:
        return all([c.reset_prefix_cache() for c in self.clients])

    def call_utility(self, method: str, *args: object, timeout: float | None = None) -> list:
        """The utility's result from every core, in core order."""
        return [c.call_utility(method, *args, timeout=timeout) for c in self.clients]


class DPAsyncMPClient(_DPClient):
    """asyncio DP client for AsyncLLM (`jaxllm serve --data-parallel-size N`)."""

    def __init__(self, config: EngineConfig | Future, data_parallel_size: int,
                 tensor_parallel_size: int, startup_timeout_s: float | None = None):
        self._outputs: asyncio.Queue | None = None
        self._start(lambda p: AsyncMPClient(config, startup_timeout_s, placement=p),
                    data_parallel_size, tensor_parallel_size)

    def _ensure_reader(self) -> asyncio.Queue:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
            for c in self.clients:
                c._ensure_reader(self._outputs)
        return self._outputs

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = self._ensure_reader()
        item = await outputs.get()
        if isinstance(item, BaseException):
            outputs.put_nowait(item)
            raise item
        self.balancer.observe(item)
        return item

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("DPAsyncMPClient: use `await get_output_async()`")

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError("DPAsyncMPClient: use `await reset_prefix_cache_async()`")

    async def reset_prefix_cache_async(self) -> bool:
        self._ensure_reader()
        results = await asyncio.gather(*(c.reset_prefix_cache_async() for c in self.clients))
        return all(results)

    async def call_utility_async(self, method: str, *args: object) -> list:
        """The utility's result from every core, in core order."""
        self._ensure_reader()
        return list(await asyncio.gather(*(c.call_utility_async(method, *args)
                                           for c in self.clients)))


def make_async_client(config: EngineConfig | Future, data_parallel_size: int,
                      tensor_parallel_size: int,
                      startup_timeout_s: float | None = None) -> AsyncMPClient | DPAsyncMPClient:
    """AsyncLLM's client: one core, or one per data-parallel replica."""
    if data_parallel_size == 1:
        return AsyncMPClient(config, startup_timeout_s=startup_timeout_s)
    return DPAsyncMPClient(config, data_parallel_size, tensor_parallel_size, startup_timeout_s)
