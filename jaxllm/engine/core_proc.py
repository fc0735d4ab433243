"""The engine core in its own process: `run_engine_core` and the `EngineCoreProc` busy loop.

The frontend (`core_client.MPClient`) binds three IPC sockets in a private temp
dir and spawns this process, which connects to them (the layout is vLLM v1's):

  handshake  PUSH (core) -> PULL (frontend)  one READY/FAILED message at start-up
  input      PUSH (frontend) -> PULL (core)  [type byte, msgpack payload]
  output     PUSH (core) -> PULL (frontend)  [kind byte, msgpack payload]

The busy loop drains the inputs, steps while requests are unfinished, and
otherwise blocks on the input queue. Socket I/O and (de)serialization run on
two helper threads so they overlap with the step. The core exits on a SHUTDOWN
message, on SIGTERM, when its parent process goes away, or when a step hangs past
`JAXLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` (engine/step_watchdog.py).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from jaxllm.config import EngineConfig
from jaxllm.core.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from jaxllm.distributed.dp_devices import CorePlacement, enter_placement
from jaxllm.engine.codec import (
    OUTPUTS,
    UTILITY_RESULT,
    Codec,
    EngineCoreRequestType,
    Handshake,
    UtilityCall,
    UtilityResult,
)
from jaxllm.engine.step_watchdog import ENV as STEP_TIMEOUT_ENV
from jaxllm.engine.step_watchdog import StepWatchdog, step_timeout
from jaxllm.errors import ParameterError

logger = logging.getLogger(__name__)

# Methods of EngineCore that a client may call through a UTILITY message.
UTILITY_METHODS = frozenset({"reset_prefix_cache", "has_unfinished_requests", "ping",
                             "model_summary"})

_PARENT_POLL_S = 0.5
_FATAL_FLUSH_S = 2.0  # how long a hung core waits for its last message to go out



class EngineCoreProc:
    """The engine core's busy loop, run inside the spawned process."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 ctx: zmq.Context):
        from jaxllm.engine.core import EngineCore, freeze_gc

        timeout = step_timeout()  # a bad value fails the start, before the model loads
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
        if self.engine_core.lockstep is not None:  # a follower host lost: tell the frontend
            self.engine_core.lockstep.on_lost = self.report_fatal
        self.watchdog = StepWatchdog(timeout, self._step_hung)

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
            except Exception as e:  # one bad message must not stop the input thread
                self._answer_undecodable(frames, e)

    def _answer_undecodable(self, frames: list, error: Exception) -> None:
        """Fails the request (or utility call) of a message that does not decode, so that
        its client gets an answer instead of waiting for ever."""
        reason = f"the engine core could not decode the request: {type(error).__name__}: {error}"
        try:
            kind = EngineCoreRequestType(bytes(frames[0].buffer))
            raw = msgspec.msgpack.decode(frames[1].buffer)
        except Exception:
            kind, raw = None, None
        if kind == EngineCoreRequestType.ADD and isinstance(raw, dict) \
                and isinstance(raw.get("request_id"), str):
            logger.error("rejecting request %s: %s", raw["request_id"], reason)
            out = EngineCoreOutput(raw["request_id"], [], finish_reason=FinishReason.ERROR,
                                   stop_reason=reason)
            self.output_queue.put((OUTPUTS, EngineCoreOutputs(outputs=[out])))
        elif kind == EngineCoreRequestType.UTILITY and isinstance(raw, list) and raw \
                and isinstance(raw[0], int):
            self.output_queue.put((UTILITY_RESULT, UtilityResult(raw[0], False, reason)))
        else:
            logger.error("an input message names no request to answer; ignored: %s", reason)

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
                with self.watchdog.step():
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

    def _step_hung(self, seconds: float) -> None:
        """From the watchdog's thread: the step thread is blocked for good (in the
        device's wait), so tell the frontend why and exit the process."""
        error = (f"an engine step ran {seconds:.0f}s, past {STEP_TIMEOUT_ENV}="
                 f"{self.watchdog.timeout_s:g}: the device did not finish it")
        logger.error("%s; the engine core exits", error)
        self.report_fatal(error)
        deadline = time.monotonic() + _FATAL_FLUSH_S
        while not self.output_queue.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the output thread took the message: let its send finish
        os._exit(1)

    def close(self) -> None:
        self._stop.set()
        self.watchdog.close()
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
                    config_conn: multiprocessing.connection.Connection | None = None,
                    placement: CorePlacement | None = None) -> None:
    """Entry point of the engine core process (multiprocessing 'spawn' target).

    Without a config, the core first starts JAX and imports the model code, then
    takes its config from `config_conn` when the frontend has built it: the
    frontend's config build (transformers, and PyTorch where installed) overlaps
    the core's JAX start, and the core never imports either library.

    `placement` makes it one data-parallel replica: it sees only its own TPU chips
    or GPUs (its environment set before JAX starts) and takes its rank into its config.
    """
    name = "EngineCore" if placement is None else f"EngineCore_DP{placement.rank}"
    logging.basicConfig(level=log_level,
                        format=f"%(levelname)s %(asctime)s [{name}] %(name)s: %(message)s")
    placement_error: ParameterError | None = None
    if placement is not None:
        try:
            enter_placement(placement)
        except ParameterError as e:  # answered through the handshake below
            placement_error = e
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
    if placement is not None:
        config = dataclasses.replace(config, parallel_config=dataclasses.replace(
            config.parallel_config, data_parallel_rank=placement.rank))
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PUSH)
    handshake.setsockopt(zmq.LINGER, 5000)
    handshake.connect(addresses["handshake"])
    codec = Codec()
    proc: EngineCoreProc | None = None
    try:
        if placement_error is not None:
            raise placement_error
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


