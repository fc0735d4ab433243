"""Multi-host lockstep: host 0's model runner calls, replayed by the follower hosts.

In a multi-host engine (distributed/multihost.py) every process holds a part
of the mesh, and every process must launch the same SPMD programs in the same
order. Host 0 runs the engine core; a follower runs only a model runner.

The side channel is ZeroMQ over TCP, at the coordinator's host and port + 1:
host 0 binds a ROUTER, each follower connects a DEALER (its identity is its
process id) and says hello; host 0 answers with the engine config, so that
every host builds the same runner (same buckets, same programs). From then on
host 0 sends each runner call that reaches the device before making it
itself: `dispatch` (the SchedulerOutput), `dispatch_sample` (the grammar
bitmask), `collect`, `execute_model` and `precompile`. A follower keeps its
own InputBatch, so each call turns into the very same packed host arrays
and the very same jitted calls there; the jitted step then runs on the global
arrays, each process feeding its own devices' shards. Step handles cross the
channel as sequence numbers. A broadcast SchedulerOutput, not a per-step
device collective, keeps the hosts' inputs equal: it costs host 0 one pickle
and one send per call, and nothing at all in a single-process engine, which
never builds any of this.

Death: each side watches its socket (a ZeroMQ monitor for disconnects, and
ZMTP heartbeats so that a host gone silent drops its connection too). When a
follower goes, host 0 may be blocked in a collective that will never
complete, so its core process reports the engine error to the frontend and
exits: the frontend sees an engine-core death (/health 503). When host 0
goes, a follower exits.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from jaxllm.config import EngineConfig
from jaxllm.distributed.multihost import DistributedSpec, initialize

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # how long host 0 waits for the followers' hellos (and they for it)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
_LOST_FLUSH_S = 0.5  # time for the engine error to reach the frontend before the exit
_HELLO, _STOP = b"hello", ("stop",)
# How long a follower whose host 0 went away waits for host 0's stop among the calls it
# has yet to replay, before it takes the disconnect for a lost host 0.
LEADER_GRACE_S = 10.0


def _socket(ctx: zmq.Context, kind: int) -> tuple[zmq.Socket, zmq.Socket]:
    """A socket with ZMTP heartbeats, and the monitor socket of its disconnects."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    return sock, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


class _Watch:
    """A thread that calls `lost` on the first disconnect of a socket, until `stop()`."""

    def __init__(self, monitor: zmq.Socket, lost: Callable[[], None]):
        self.monitor, self.lost = monitor, lost
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lockstep-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            # Polled, so that `stop` ends the thread before the socket closes.
            if not self.monitor.poll(200):
                continue
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED and not self.stopping.is_set():
                self.lost()
                return

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)
        self.monitor.close(linger=0)


def _address(spec: DistributedSpec) -> str:
    host, port = spec.side_channel()
    return f"tcp://{socket.gethostbyname(host)}:{port}"


class LockstepLeader:
    """Host 0's end of the side channel: the followers' hellos, then one send per call."""

    def __init__(self, spec: DistributedSpec, config: EngineConfig,
                 timeout_s: float = STARTUP_TIMEOUT_S):
        self.ctx = zmq.Context()
        self.sock, self._monitor = _socket(self.ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone follower raises
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(_address(spec))
        # Called (from the watch thread) with the reason when a follower is lost,
        # before this process exits; the core process reports it to the frontend.
        self.on_lost: Callable[[str], None] | None = None
        self._stopping = threading.Event()
        self._watch: _Watch | None = None
        self.followers: list[bytes] = []
        want = spec.num_processes - 1
        deadline = time.monotonic() + timeout_s
        while len(self.followers) < want:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                self.close()
                raise TimeoutError(f"{len(self.followers)} of {want} follower hosts said "
                                   f"hello within {timeout_s:.0f}s")
            ident, msg = self.sock.recv_multipart()
            if msg == _HELLO and ident not in self.followers:
                self.followers.append(ident)
        payload = pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL)
        for ident in self.followers:
            self.sock.send_multipart((ident, payload))
        logger.info("lockstep: %d follower host(s) joined", want)
        self._watch = _Watch(self._monitor, self._lost)

    def send(self, call: tuple) -> None:
        """One runner call to every follower (before host 0 makes it)."""
        payload = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for ident in self.followers:
                self.sock.send_multipart((ident, payload), copy=False)
        except zmq.ZMQError as e:
            self._lost(f"cannot reach a follower host: {e}")

    def _lost(self, reason: str = "a follower host disconnected") -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        logger.error("lockstep: %s; the engine cannot step any more", reason)
        if self.on_lost is not None:
            try:
                self.on_lost(f"multi-host engine: {reason}")
                time.sleep(_LOST_FLUSH_S)
            except Exception:
                logger.exception("lockstep: reporting the lost follower failed")
        # The step under way may wait in a collective for ever: leave now.
        os._exit(1)

    def close(self) -> None:
        """Tells the followers to stop, then releases the sockets."""
        if self._stopping.is_set() and not self.followers:
            return
        self._stopping.set()
        try:
            for ident in self.followers:
                self.sock.send_multipart((ident, pickle.dumps(_STOP)))
        except zmq.ZMQError:
            pass
        self.followers = []
        if self._watch is not None:
            self._watch.stop()
        else:
            self._monitor.close(linger=0)
        self.sock.close()
        self.ctx.term()


@dataclass
class LockstepHandle:
    """A step handle as host 0's engine core holds it: the runner's, and its number."""

    seq: int
    inner: Any


class LeaderRunner:
    """Host 0's model runner: each call that reaches the device goes to the followers
    first. Everything else reads through to the runner."""

    def __init__(self, runner: Any, leader: LockstepLeader):
        self._runner, self._leader = runner, leader
        self._seq = itertools.count()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def precompile(self) -> None:
        self._leader.send(("precompile",))
        self._runner.precompile()

    def execute_model(self, so: Any) -> Any:
        self._leader.send(("execute_model", so))
        return self._runner.execute_model(so)

    def dispatch(self, so: Any, sample: bool = True) -> LockstepHandle:
        seq = next(self._seq)
        self._leader.send(("dispatch", seq, so, sample))
        return LockstepHandle(seq, self._runner.dispatch(so, sample))

    def dispatch_sample(self, h: LockstepHandle, grammar_bitmask: Any) -> None:
        self._leader.send(("dispatch_sample", h.seq, grammar_bitmask))
        self._runner.dispatch_sample(h.inner, grammar_bitmask)

    def collect(self, h: LockstepHandle) -> Any:
        self._leader.send(("collect", h.seq))
        return self._runner.collect(h.inner)


def make_runner(config: EngineConfig) -> Any:
    """The model runner an engine core of this config runs (EngineCore's choice)."""
    if config.model_config.is_encoder:
        from jaxllm.worker.encoder_runner import EncoderModelRunner as Runner
    else:
        from jaxllm.worker.model_runner import ModelRunner as Runner
    return Runner(config)


def run_follower(spec: DistributedSpec, timeout_s: float = STARTUP_TIMEOUT_S) -> int:
    """A follower host's whole life: join the job, take host 0's config, build the
    runner, then replay host 0's calls until it says stop (0) or goes away (exit 1)."""
    spec = initialize(spec)
    ctx = zmq.Context()
    sock, monitor = _socket(ctx, zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(spec.process_id).encode())
    sock.connect(_address(spec))
    sock.send(_HELLO)
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"host 0 did not answer within {timeout_s:.0f}s")
    config: EngineConfig = pickle.loads(sock.recv())

    stopped = threading.Event()

    def leader_lost() -> None:
        # Host 0 closes its end right after its last call, stop, and this host may still
        # be replaying the calls before it: a disconnect is a loss only if no stop follows.
        if stopped.wait(LEADER_GRACE_S):
            return
        logger.error("lockstep: host 0 disconnected; this follower exits")
        os._exit(1)

    watch = _Watch(monitor, leader_lost)
    logger.info("lockstep follower %d of %d: building the model runner", spec.process_id,
                spec.num_processes)
    runner = make_runner(config)
    handles: dict[int, Any] = {}
    while True:
        call = pickle.loads(sock.recv())
        kind = call[0]
        if kind == "dispatch":
            _, seq, so, sample = call
            handles[seq] = runner.dispatch(so, sample)
        elif kind == "dispatch_sample":
            runner.dispatch_sample(handles[call[1]], call[2])
        elif kind == "collect":
            runner.collect(handles.pop(call[1]))
        elif kind == "execute_model":
            runner.execute_model(call[1])
        elif kind == "precompile":
            runner.precompile()
        elif kind == "stop":
            stopped.set()
            break
        else:
            raise RuntimeError(f"lockstep: unknown call {kind!r} from host 0")
    watch.stop()
    logger.info("lockstep follower %d: host 0 stopped the engine", spec.process_id)
    sock.close(linger=0)
    ctx.term()
    return 0
