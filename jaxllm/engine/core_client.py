"""How the frontend talks to the engine core.

`EngineCoreClient` is the interface. `InprocClient` runs the core in this
process (tests, simple offline use). `MPClient` starts the core's process
(`core_launch.py`), talks to it over ZeroMQ and watches for its death;
`SyncMPClient` (LLMEngine) and `AsyncMPClient` (AsyncLLM) read its outputs.
Data parallelism holds one of these per core (dp_client.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from jaxllm.config import EngineConfig
from jaxllm.core.messages import EngineCoreOutputs, EngineCoreRequest
from jaxllm.distributed.dp_devices import CorePlacement
from jaxllm.engine.codec import UTILITY_RESULT, Codec, EngineCoreRequestType, UtilityCall
from jaxllm.engine.core_launch import launch_core
from jaxllm.errors import EngineDeadError

logger = logging.getLogger(__name__)

_ATTACH_TIMEOUT_MS = 5000  # how long a send waits for a live core's socket to attach


def multiprocess_default() -> bool:
    """Whether LLM runs its engine core in a separate process.

    `JAXLLM_ENABLE_MULTIPROCESSING=1` turns it on (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING). It stays off by default because offline
    batches gain nothing from it: the frontend's share of a step is small and,
    with async scheduling, the in-process engine already keeps the device busy
    (BENCHMARKS.md), so a second process has no host time left to hide. The
    server always uses it.
    """
    return os.environ.get("JAXLLM_ENABLE_MULTIPROCESSING", "0").lower() in ("1", "true", "yes")


class EngineCoreClient(ABC):
    max_request_tokens: int

    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool = False) -> EngineCoreClient:
        if multiprocess:
            return SyncMPClient(config)
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        pass


def read_output(outputs: queue.Queue, engine_dead: bool,
                dead_error: Callable[[], BaseException]) -> EngineCoreOutputs:
    """The next item of a client's output queue; an error stays queued, so that every
    later caller sees it too."""
    if engine_dead and outputs.empty():
        raise dead_error()
    item = outputs.get()
    if isinstance(item, BaseException):
        outputs.put(item)
        raise item
    return item


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig):
        from jaxllm.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self.max_request_tokens = self.engine_core.max_request_tokens
        self._rejected: deque = deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        err = self.engine_core.add_request(request)
        if err is not None:
            self._rejected.append(err)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.engine_core.step()
        while self._rejected:
            outputs.outputs.append(self._rejected.popleft())
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def model_summary(self) -> dict:
        return self.engine_core.model_summary()

    def shutdown(self) -> None:
        self.engine_core.shutdown()



class MPClient(EngineCoreClient):
    """Spawns the core process, owns the sockets, watches for the core's death."""

    def __init__(self, config: EngineConfig | Future, use_asyncio: bool,
                 startup_timeout_s: float | None = None,
                 placement: CorePlacement | None = None):
        """`config` may still be in the making (a Future): see `launch_core`. With
        `placement`, the core is one data-parallel replica (dp_client.py)."""
        self.engine_index = 0 if placement is None else placement.rank
        self.codec = Codec()
        self.engine_dead = False
        self.engine_error: str | None = None
        self._closing = False
        self._call_ids = itertools.count()
        self._core = launch_core(config, use_asyncio, startup_timeout_s, placement)
        self.proc, self.ctx = self._core.proc, self._core.ctx
        self.input_socket = self._core.input_socket
        self.output_socket: Any = self._core.output_socket
        assert self._core.info is not None
        self.max_request_tokens = self._core.info.max_request_tokens
        self.num_blocks = self._core.info.num_blocks
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._monitor_engine, name="core-monitor",
                                         daemon=True)
        self._monitor.start()

    def _monitor_engine(self) -> None:
        multiprocessing.connection.wait([self.proc.sentinel, self._wake_r])
        if self._closing:
            return
        # The sentinel fires as the process closes its files, a moment before it can be reaped.
        self.proc.join(timeout=1.0)
        logger.error("the engine core process died (exit code %s)", self.proc.exitcode)
        self._mark_dead(self.engine_error or
                        f"the engine core process died (exit code {self.proc.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if self.engine_dead:
            return
        self.engine_error = reason
        self.engine_dead = True
        self._on_engine_dead()

    def _on_engine_dead(self) -> None:
        """Wakes up whoever waits for outputs or utility results (subclasses)."""

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(self.engine_error or "the engine core is not running")

    def _send(self, req_type: EngineCoreRequestType, payload: bytes) -> None:
        if self.engine_dead or self._closing:
            raise self.dead_error()
        frames = (req_type.value, payload)
        try:
            # NOBLOCK: with no peer (the core is gone) a PUSH socket would block forever.
            self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again as e:
            # ZeroMQ connects in the background: right after READY the core's end
            # may not be attached yet. A live core is given a moment to attach.
            if (self.proc.exitcode is not None
                    or not self.input_socket.poll(_ATTACH_TIMEOUT_MS, zmq.POLLOUT)):
                raise self.dead_error() from e
            self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, self.codec.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not (self.engine_dead or self._closing):
            self._send(EngineCoreRequestType.ABORT, self.codec.encode(list(request_ids)))

    def _dispatch(self, frames: list) -> None:
        """One output-socket message: resolve a utility call, or hand on the outputs."""
        kind, payload = frames
        if bytes(kind) == UTILITY_RESULT:
            result = self.codec.result_decoder.decode(payload)
            fut = self._pending.pop(result.call_id, None)
            if fut is not None and not fut.done():
                if result.ok:
                    fut.set_result(result.result)
                else:
                    fut.set_exception(RuntimeError(result.result))
            return
        outputs = self.codec.outputs_decoder.decode(payload)
        outputs.engine_index = self.engine_index
        self._put_output(outputs)
        if outputs.engine_error is not None:
            self._mark_dead(f"engine core error: {outputs.engine_error}")

    def _put_output(self, outputs: EngineCoreOutputs) -> None:
        raise NotImplementedError

    def _send_utility(self, fut: Any, method: str, args: tuple) -> None:
        call_id = next(self._call_ids)
        self._pending[call_id] = fut
        try:
            self._send(EngineCoreRequestType.UTILITY,
                       self.codec.encode(UtilityCall(call_id, method, list(args))))
        except BaseException:
            self._pending.pop(call_id, None)
            raise

    def is_alive(self) -> bool:
        return not self.engine_dead and self.proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._wake_w.send(b"")
        except (OSError, AttributeError):
            pass
        if self.proc.is_alive():
            try:
                self.input_socket.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""),
                                                 flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._core.close()

class SyncMPClient(MPClient):
    """Blocking client: `get_output()` waits for the next EngineCoreOutputs (LLMEngine, LLM)."""

    def __init__(self, config: EngineConfig | Future, startup_timeout_s: float | None = None,
                 placement: CorePlacement | None = None,
                 outputs: queue.Queue | None = None):
        """`outputs`: a queue shared with the other replicas' clients (dp_client.py)."""
        self._outputs: queue.Queue = queue.Queue() if outputs is None else outputs
        self._pending: dict[int, Future] = {}
        super().__init__(config, use_asyncio=False, startup_timeout_s=startup_timeout_s,
                         placement=placement)
        self._reader = threading.Thread(target=self._read_outputs, name="client-output",
                                        daemon=True)
        self._reader.start()

    def _read_outputs(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        while not self._closing:
            try:
                if not poller.poll(200):
                    continue
                self._dispatch(self.output_socket.recv_multipart())
            except zmq.ZMQError:
                return  # the socket closed under us during shutdown

    def _put_output(self, outputs: EngineCoreOutputs) -> None:
        self._outputs.put(outputs)

    def _on_engine_dead(self) -> None:
        self._outputs.put(self.dead_error())
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(self.dead_error())
        self._pending.clear()

    def get_output(self) -> EngineCoreOutputs:
        return read_output(self._outputs, self.engine_dead, self.dead_error)

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        fut: Future = Future()
        self._send_utility(fut, method, args)
        if self.engine_dead and not fut.done():  # died between the check and the send
            fut.set_exception(self.dead_error())
        return fut.result(timeout)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    def model_summary(self) -> dict:
        return self.call_utility("model_summary")


class AsyncMPClient(MPClient):
    """asyncio client for AsyncLLM: one reader task turns output frames into a queue."""

    def __init__(self, config: EngineConfig | Future,
                 startup_timeout_s: float | None = None,
                 placement: CorePlacement | None = None):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        super().__init__(config, use_asyncio=True, startup_timeout_s=startup_timeout_s,
                         placement=placement)

    def _ensure_reader(self, shared: asyncio.Queue | None = None) -> asyncio.Queue:
        """Starts the reader task on the running loop; its outputs go to `shared`
        where given (one queue for every data-parallel replica: dp_client.py)."""
        if self._outputs is None:
            self._loop = asyncio.get_running_loop()
            self._outputs = asyncio.Queue() if shared is None else shared
            self._reader = self._loop.create_task(self._read_outputs())
            if self.engine_dead:
                self._fail_waiters()
        return self._outputs

    async def _read_outputs(self) -> None:
        assert self._outputs is not None
        while True:
            try:
                frames = await self.output_socket.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._dispatch(frames)

    def _put_output(self, outputs: EngineCoreOutputs) -> None:
        assert self._outputs is not None
        self._outputs.put_nowait(outputs)

    def _on_engine_dead(self) -> None:
        # Called from the monitor thread (or the reader task): hop onto the loop.
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._fail_waiters)
        except RuntimeError:
            pass  # the loop is closed; nobody is waiting

    def _fail_waiters(self) -> None:
        if self._outputs is not None:
            self._outputs.put_nowait(self.dead_error())
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self.dead_error())
        self._pending.clear()

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = self._ensure_reader()
        item = await outputs.get()
        if isinstance(item, BaseException):
            outputs.put_nowait(item)
            raise item
        return item

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("AsyncMPClient: use `await get_output_async()`")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_reader()
        assert self._loop is not None
        fut = self._loop.create_future()
        self._send_utility(fut, method, args)
        return await fut

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError("AsyncMPClient: use `await reset_prefix_cache_async()`")

    async def reset_prefix_cache_async(self) -> bool:
        return bool(await self.call_utility_async("reset_prefix_cache"))

    def shutdown(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        super().shutdown()

