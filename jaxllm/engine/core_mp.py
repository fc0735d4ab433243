"""The engine core in its own process, and the clients that talk to it over ZeroMQ.

Layout (as in vLLM v1): the frontend binds three IPC sockets in a private temp
dir and spawns `EngineCoreProc`, which connects to them.

  handshake  PUSH (core) -> PULL (frontend)  one READY/FAILED message at start-up
  input      PUSH (frontend) -> PULL (core)  [type byte, msgpack payload]
  output     PUSH (core) -> PULL (frontend)  [kind byte, msgpack payload]

The core process runs a busy loop: drain the inputs, step while requests are
unfinished, otherwise block on the input queue. Socket I/O and (de)serialization
run on two helper threads so they overlap with the step. The core exits on a
SHUTDOWN message, on SIGTERM, or when its parent process goes away; the
frontend watches the process sentinel and fails everything fast when the core
dies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import jaxllm
from jaxllm.config import EngineConfig, portable_config
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from jaxllm.errors import EngineDeadError, ParameterError

logger = logging.getLogger(__name__)

# First frame of every message on the output socket.
OUTPUTS = b"O"
UTILITY_RESULT = b"U"

# Methods of EngineCore that a client may call through a UTILITY message.
UTILITY_METHODS = frozenset({"reset_prefix_cache", "has_unfinished_requests", "ping"})

_PARENT_POLL_S = 0.5
_ATTACH_TIMEOUT_MS = 5000  # how long a send waits for a live core's socket to attach
_SHUTDOWN_TIMEOUT_S = 5.0


def multiprocess_default() -> bool:
    """Whether LLM runs its engine core in a separate process.

    `JAXLLM_ENABLE_MULTIPROCESSING=1` turns it on (vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING). It stays off by default: on the CPU it
    measured no faster for offline batches (the frontend's share of a step is
    small and the two processes compete for cores), and on the H100 the
    in-process engine with async scheduling already keeps the device 96-99%
    busy (BENCHMARKS.md, profiles of decode-1 and throughput), so a second
    process has no host time left to hide. The server always uses it.
    """
    return os.environ.get("JAXLLM_ENABLE_MULTIPROCESSING", "0").lower() in ("1", "true", "yes")


class Handshake(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    status: str  # "READY" | "FAILED"
    max_request_tokens: int = 0
    num_blocks: int = 0
    error: str | None = None


class UtilityCall(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    call_id: int
    ok: bool
    result: Any = None  # the return value, or the error text when not ok


class Codec:
    """msgpack encoder plus one typed decoder per message kind."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
        self.outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.result_decoder = msgspec.msgpack.Decoder(UtilityResult)
        self.handshake_decoder = msgspec.msgpack.Decoder(Handshake)

    def encode(self, obj: Any) -> bytes:
        return self.encoder.encode(obj)

    def decode_input(self, kind: bytes, payload: bytes) -> tuple[EngineCoreRequestType, Any]:
        req_type = EngineCoreRequestType(kind)
        if req_type == EngineCoreRequestType.ADD:
            return req_type, self.request_decoder.decode(payload)
        if req_type == EngineCoreRequestType.ABORT:
            return req_type, self.abort_decoder.decode(payload)
        if req_type == EngineCoreRequestType.UTILITY:
            return req_type, self.utility_decoder.decode(payload)
        return req_type, None


# ----------------------------------------------------------------------------- core process


class EngineCoreProc:
    """The engine core's busy loop, run inside the spawned process."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 ctx: zmq.Context):
        from jaxllm.engine.core import EngineCore, freeze_gc

        self.engine_core = EngineCore(config)
        freeze_gc()
        self.codec = Codec()
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._stats_dirty = False
        self.input_socket = ctx.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.output_socket = ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.LINGER, 2000)
        self.output_socket.connect(output_address)
        self._threads = [
            threading.Thread(target=self._input_thread, name="core-input", daemon=True),
            threading.Thread(target=self._output_thread, name="core-output", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def request_stop(self) -> None:
        """Safe from a signal handler: the wake-up is queued from a fresh thread."""
        self._stop.set()
        threading.Thread(target=self.input_queue.put,
                         args=((EngineCoreRequestType.SHUTDOWN, None),), daemon=True).start()

    def _input_thread(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                frames = self.input_socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("engine core input thread failed")
                os._exit(1)
            try:
                kind, payload = frames
                self.input_queue.put(self.codec.decode_input(bytes(kind.buffer),
                                                             payload.buffer))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                logger.error("dropping an undecodable input message: %s", e)

    def _output_thread(self) -> None:
        try:
            while True:
                item = self.output_queue.get()
                if item is None:
                    return
                kind, obj = item
                self.output_socket.send_multipart((kind, self.codec.encode(obj)), copy=False)
        except Exception:
            # Without this thread nothing reaches the frontend: die loudly, never hang it.
            logger.exception("engine core output thread failed")
            os._exit(1)

    def run_busy_loop(self) -> None:
        while not self._stop.is_set():
            self._process_inputs()
            if self._stop.is_set():
                break
            if self.engine_core.has_unfinished_requests() or self._stats_dirty:
                # An idle step still reports stats, e.g. the KV usage after an abort.
                self._stats_dirty = False
                outputs = self.engine_core.step()
                if (outputs.outputs or outputs.token_req_ids
                        or outputs.scheduler_stats is not None):
                    self.output_queue.put((OUTPUTS, outputs))

    def _process_inputs(self) -> None:
        busy = self.engine_core.has_unfinished_requests() or self._stats_dirty
        while True:
            try:
                item = self.input_queue.get(block=not busy, timeout=None)
            except queue.Empty:
                return
            self._handle(*item)
            busy = True  # after one message, take only what is already queued
            if self._stop.is_set():
                return

    def _handle(self, req_type: EngineCoreRequestType, obj: Any) -> None:
        if req_type == EngineCoreRequestType.ADD:
            try:
                err = self.engine_core.add_request(obj)
            except Exception as e:  # one bad request must not take the core down
                logger.exception("rejecting request %s", obj.request_id)
                err = EngineCoreOutput(obj.request_id, [], finish_reason=FinishReason.ERROR,
                                       stop_reason=f"{type(e).__name__}: {e}")
            if err is not None:
                self.output_queue.put((OUTPUTS, EngineCoreOutputs(outputs=[err])))
        elif req_type == EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(obj)
            self._stats_dirty = True
        elif req_type == EngineCoreRequestType.UTILITY:
            self.output_queue.put((UTILITY_RESULT, self._call_utility(obj)))
        elif req_type == EngineCoreRequestType.SHUTDOWN:
            self._stop.set()

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, False, f"unknown utility method {call.method!r}")
        if call.method == "ping":
            return UtilityResult(call.call_id, True, True)
        try:
            result = getattr(self.engine_core, call.method)(*call.args)
        except Exception as e:  # reported to the caller; the core keeps running
            return UtilityResult(call.call_id, False, f"{type(e).__name__}: {e}")
        if call.method == "reset_prefix_cache":
            self._stats_dirty = True
        return UtilityResult(call.call_id, True, result)

    def report_fatal(self, error: str) -> None:
        self.output_queue.put((OUTPUTS, EngineCoreOutputs(engine_error=error)))

    def close(self) -> None:
        self._stop.set()
        self.output_queue.put(None)
        for t in self._threads:
            t.join(timeout=3.0)
        self.input_socket.close(linger=0)
        self.output_socket.close()  # lingers so the last outputs still go out
        self.engine_core.shutdown()


def _watch_parent(parent_pid: int) -> None:
    """Exit when the frontend process is gone (so a killed server leaves no orphan)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _start_jax() -> None:
    """Initializes the JAX backend and imports what building the engine needs."""
    import jax

    import jaxllm.engine.core  # noqa: F401  (the model runner, models, kernels)

    jax.devices()


def run_engine_core(config: EngineConfig | None, addresses: dict[str, str],
                    parent_pid: int, log_level: int = logging.INFO,
                    spawned_at: float | None = None,
                    config_conn: multiprocessing.connection.Connection | None = None) -> None:
    """Entry point of the engine core process (multiprocessing 'spawn' target).

    Without a config, the core first starts JAX and imports the model code, then
    takes its config from `config_conn` when the frontend has built it: the
    frontend's config build (transformers, and PyTorch where installed) overlaps
    the core's JAX start, and the core never imports either library.
    """
    logging.basicConfig(level=log_level,
                        format="%(levelname)s %(asctime)s [EngineCore] %(name)s: %(message)s")
    if spawned_at is not None:
        logger.info("engine core process running %.1fs after its spawn (interpreter, imports)",
                    time.time() - spawned_at)
    # Ctrl-C reaches the whole process group; the frontend decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="parent-watch").start()
    if config is None:
        t0 = time.perf_counter()
        _start_jax()
        logger.info("JAX started and the model code imported in %.1fs",
                    time.perf_counter() - t0)
        try:
            config = config_conn.recv()
        except EOFError:
            config = None
        if config is None:  # the frontend could not build the config; it reports why
            os._exit(0)
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PUSH)
    handshake.setsockopt(zmq.LINGER, 5000)
    handshake.connect(addresses["handshake"])
    codec = Codec()
    proc: EngineCoreProc | None = None
    try:
        proc = EngineCoreProc(config, addresses["input"], addresses["output"], ctx)
        signal.signal(signal.SIGTERM, lambda *_: proc.request_stop())
        handshake.send(codec.encode(Handshake(
            "READY", max_request_tokens=proc.engine_core.max_request_tokens,
            num_blocks=config.cache_config.num_blocks)))
        handshake.close()
        proc.run_busy_loop()
    except Exception as e:
        if isinstance(e, ParameterError):  # bad input: the frontend reports it too
            logger.error("engine core not started: %s", e)
        else:
            logger.error("engine core failed:\n%s", traceback.format_exc())
        if proc is None:
            handshake.send(codec.encode(Handshake("FAILED", error=f"{type(e).__name__}: {e}")))
            handshake.close()
        else:
            proc.report_fatal(f"{type(e).__name__}: {e}")
            proc.close()
        ctx.term()
        os._exit(1)
    proc.close()
    ctx.destroy(linger=2000)
    logger.info("engine core shut down")
    logging.shutdown()
    # Everything is flushed; skip the interpreter's slow teardown of the XLA runtime,
    # but release what multiprocessing tracks (tqdm's semaphore) first.
    multiprocessing.util._run_finalizers()
    os._exit(0)


# ----------------------------------------------------------------------------- frontend side


class MPClient(EngineCoreClient):
    """Spawns the core process, owns the sockets, watches for the core's death."""

    def __init__(self, config: EngineConfig | Future, use_asyncio: bool,
                 startup_timeout_s: float | None = None):
        """`config` may still be in the making (a Future): the core then starts JAX
        meanwhile and receives the config once it is built."""
        self.codec = Codec()
        self.engine_dead = False
        self.engine_error: str | None = None
        self._closing = False
        self._call_ids = itertools.count()
        self._ipc_dir = tempfile.mkdtemp(prefix="jaxllm-ipc-")
        addresses = {name: f"ipc://{os.path.join(self._ipc_dir, name)}"
                     for name in ("handshake", "input", "output")}
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(addresses["input"])
        if use_asyncio:
            self.actx: zmq.asyncio.Context | None = zmq.asyncio.Context.shadow(self.ctx)
            self.output_socket: Any = self.actx.socket(zmq.PULL)
        else:
            self.actx = None
            self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(addresses["output"])
        handshake = self.ctx.socket(zmq.PULL)
        handshake.setsockopt(zmq.LINGER, 0)
        handshake.bind(addresses["handshake"])

        mp = multiprocessing.get_context("spawn")
        spawned_at = time.time()
        pending = isinstance(config, Future)
        conn_r, conn_w = mp.Pipe(duplex=False) if pending else (None, None)
        self.proc = mp.Process(target=run_engine_core, name="EngineCore", daemon=True,
                               args=(None if pending else portable_config(config), addresses,
                                     os.getpid(),
                                     logging.getLogger("jaxllm").getEffectiveLevel(),
                                     spawned_at, conn_r))
        try:
            self.proc.start()
            if pending:
                conn_r.close()
                try:
                    built = config.result()
                except BaseException:
                    conn_w.close()  # the core sees EOF and exits quietly
                    raise
                try:
                    conn_w.send(portable_config(built))
                except OSError:
                    pass  # the core died while starting JAX: _wait_ready reports its exit
                conn_w.close()
            info = self._wait_ready(handshake, startup_timeout_s)
            logger.info("engine core ready %.1fs after its spawn, %.1fs after this process "
                        "imported jaxllm", time.time() - spawned_at,
                        time.time() - jaxllm.IMPORT_TIME)
        except BaseException:
            handshake.close()
            self._close_process_and_sockets()
            raise
        handshake.close()
        self.max_request_tokens = info.max_request_tokens
        self.num_blocks = info.num_blocks
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._monitor_engine, name="core-monitor",
                                         daemon=True)
        self._monitor.start()

    def _wait_ready(self, handshake: zmq.Socket, timeout_s: float | None) -> Handshake:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not handshake.poll(100):
            if self.proc.exitcode is not None:
                raise RuntimeError(f"the engine core process exited with code "
                                   f"{self.proc.exitcode} during start-up")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine core was not ready within {timeout_s}s")
        info = self.codec.handshake_decoder.decode(handshake.recv())
        if info.status != "READY":
            self.proc.join(timeout=_SHUTDOWN_TIMEOUT_S)
            raise RuntimeError(f"the engine core failed to start: {info.error}")
        return info

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
        self._close_process_and_sockets()

    def _close_process_and_sockets(self) -> None:
        self._closing = True
        if self.proc.pid is None:  # never started
            self._close_sockets()
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            return
        self.proc.join(timeout=_SHUTDOWN_TIMEOUT_S)
        if self.proc.is_alive():
            logger.warning("the engine core did not stop in %.0fs; terminating it",
                           _SHUTDOWN_TIMEOUT_S)
            self.proc.terminate()
            self.proc.join(timeout=_SHUTDOWN_TIMEOUT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._close_sockets()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _close_sockets(self) -> None:
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()


class SyncMPClient(MPClient):
    """Blocking client: `get_output()` waits for the next EngineCoreOutputs (LLMEngine, LLM)."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float | None = None):
        self._outputs: queue.Queue = queue.Queue()
        self._pending: dict[int, Future] = {}
        super().__init__(config, use_asyncio=False, startup_timeout_s=startup_timeout_s)
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
        if self.engine_dead and self._outputs.empty():
            raise self.dead_error()
        item = self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put(item)  # every later caller sees it too
            raise item
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        fut: Future = Future()
        self._send_utility(fut, method, args)
        if self.engine_dead and not fut.done():  # died between the check and the send
            fut.set_exception(self.dead_error())
        return fut.result(timeout)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))


class AsyncMPClient(MPClient):
    """asyncio client for AsyncLLM: one reader task turns output frames into a queue."""

    def __init__(self, config: EngineConfig | Future,
                 startup_timeout_s: float | None = None):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        super().__init__(config, use_asyncio=True, startup_timeout_s=startup_timeout_s)

    def _ensure_reader(self) -> asyncio.Queue:
        if self._outputs is None:
            self._loop = asyncio.get_running_loop()
            self._outputs = asyncio.Queue()
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

