"""Starting the engine core's process: private IPC sockets, the spawn, the READY handshake.

`launch_core` binds the frontend's three sockets (see `core_proc.py` for the
layout) in a private temp dir, spawns `run_engine_core` and waits for its
handshake. The `CoreProcess` it returns holds what it made; `close()` stops the
process (politely, then by force) and releases the sockets and the directory.
`MPClient` (core_client.py) owns one.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from jaxllm.config import EngineConfig, portable_config
from jaxllm.distributed.dp_devices import CorePlacement
from jaxllm.engine.codec import Codec, Handshake
from jaxllm.engine.core_proc import run_engine_core
from jaxllm.import_clock import IMPORT_TIME

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0


@dataclass
class CoreProcess:
    """The engine core's process and the frontend's ends of its sockets."""

    proc: multiprocessing.process.BaseProcess
    ctx: zmq.Context
    input_socket: zmq.Socket
    output_socket: Any  # a zmq.asyncio socket for the asyncio client
    ipc_dir: str
    async_ctx: zmq.asyncio.Context | None = None
    info: Handshake | None = None

    def close(self) -> None:
        """Waits for the process to stop (terminating, then killing it if it does not),
        then closes the sockets and removes the directory."""
        if self.proc.pid is not None:
            self.proc.join(timeout=SHUTDOWN_TIMEOUT_S)
            if self.proc.is_alive():
                logger.warning("the engine core did not stop in %.0fs; terminating it",
                               SHUTDOWN_TIMEOUT_S)
                self.proc.terminate()
                self.proc.join(timeout=SHUTDOWN_TIMEOUT_S)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_core(config: EngineConfig | Future, use_asyncio: bool,
                startup_timeout_s: float | None = None,
                placement: CorePlacement | None = None) -> CoreProcess:
    """Spawns the core and returns once it is READY; raises (leaving nothing behind) if it
    fails or times out. `config` may still be in the making (a Future): the core then
    starts JAX meanwhile and receives the config once it is built. `placement` makes
    the core one data-parallel replica (see `run_engine_core`)."""
    ipc_dir = tempfile.mkdtemp(prefix="jaxllm-ipc-")
    addresses = {name: f"ipc://{os.path.join(ipc_dir, name)}"
                 for name in ("handshake", "input", "output")}
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)
    input_socket.setsockopt(zmq.LINGER, 0)
    input_socket.bind(addresses["input"])
    async_ctx = zmq.asyncio.Context.shadow(ctx) if use_asyncio else None
    output_socket: Any = (async_ctx or ctx).socket(zmq.PULL)
    output_socket.setsockopt(zmq.LINGER, 0)
    output_socket.bind(addresses["output"])
    handshake = ctx.socket(zmq.PULL)
    handshake.setsockopt(zmq.LINGER, 0)
    handshake.bind(addresses["handshake"])

    mp = multiprocessing.get_context("spawn")
    spawned_at = time.time()
    pending = isinstance(config, Future)
    conn_r, conn_w = mp.Pipe(duplex=False) if pending else (None, None)
    name = "EngineCore" if placement is None else f"EngineCore_DP{placement.rank}"
    proc = mp.Process(target=run_engine_core, name=name, daemon=True,
                      args=(None if pending else portable_config(config), addresses,
                            os.getpid(), logging.getLogger("jaxllm").getEffectiveLevel(),
                            spawned_at, conn_r, placement))
    core = CoreProcess(proc, ctx, input_socket, output_socket, ipc_dir, async_ctx)
    try:
        proc.start()
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
        core.info = _wait_ready(proc, handshake, startup_timeout_s)
        logger.info("engine core ready %.1fs after its spawn, %.1fs after this process "
                    "imported jaxllm", time.time() - spawned_at, time.time() - IMPORT_TIME)
    except BaseException:
        handshake.close()
        core.close()
        raise
    handshake.close()
    return core


def _wait_ready(proc: multiprocessing.process.BaseProcess, handshake: zmq.Socket,
                timeout_s: float | None) -> Handshake:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not handshake.poll(100):
        if proc.exitcode is not None:
            raise RuntimeError(f"the engine core process exited with code "
                               f"{proc.exitcode} during start-up")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the engine core was not ready within {timeout_s}s")
    info = Codec().handshake_decoder.decode(handshake.recv())
    if info.status != "READY":
        proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        raise RuntimeError(f"the engine core failed to start: {info.error}")
    return info
