"""Multi-host engines: which process this is, `jax.distributed` start-up, agreeing on sizes.

One engine may span several hosts (processes): every process joins one
`jax.distributed` job, so that `jax.devices()` lists the devices of all of
them and the engine's mesh takes `tensor_parallel_size` of those. Process 0
runs the frontend, the engine core and the scheduler; every other process is
a follower that runs the same step programs in lockstep (engine/lockstep.py).

The job is named the way vLLM / tpu-inference users name it: the flags
`--distributed-coordinator-address host:port`, `--distributed-num-processes N`,
`--distributed-process-id i` (the same `LLM(...)` keywords), else the
environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`).
A flag wins over its variable. On a TPU VM slice the rest can be found:
`--distributed-num-processes 0` (or `JAX_NUM_PROCESSES=0`) asks JAX's own
cluster detection (what a bare `jax.distributed.initialize()` runs) for the
coordinator, the process count and this host's id. The job is opt-in: with
none of these set the engine is one process, and no metadata server is asked.

The lockstep side channel (host 0 to the followers) listens on the
coordinator's host at the coordinator's port + 1.

On the CPU (tests: fake devices in several processes on one machine) the
cross-process collectives are gloo's (`jax_cpu_collectives_implementation`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from jaxllm.errors import ParameterError

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


@dataclass(frozen=True)
class DistributedSpec:
    """One process's place in a multi-host job."""

    coordinator_address: str
    num_processes: int
    process_id: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def side_channel(self) -> tuple[str, int]:
        """(host, port) of the lockstep channel: the coordinator's host, its port + 1."""
        host, port = _split_address(self.coordinator_address)
        return host, port + 1


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ParameterError("distributed_coordinator_address",
                             f"must be host:port (a port below 65535), got {address!r}")
    return host.strip("[]"), int(port)


def _int_field(name: str, value: int | str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ParameterError(f"distributed_{name}",
                             f"must be an integer, got {value!r}") from None


def check_engine_host(spec: DistributedSpec | None, data_parallel_size: int) -> None:
    """An engine is built on host 0 of a job only, as its one replica."""
    if spec is not None and spec.process_id > 0:
        raise ParameterError("distributed_process_id",
                             f"process {spec.process_id} is a follower host, which builds no "
                             "engine: run `jaxllm serve` there with the same --distributed-* "
                             "flags (it follows host 0)")
    if spec is not None and data_parallel_size > 1:
        raise ParameterError("data_parallel_size", "a multi-host engine runs one replica; use "
                             "data_parallel_size=1 with distributed_num_processes")


def resolve_distributed(coordinator_address: str | None = None,
                        num_processes: int | str | None = None,
                        process_id: int | str | None = None) -> DistributedSpec | None:
    """The job from the flags, else the environment; None for a single-process engine.

    Raises ParameterError naming the field for a bad or missing value.
    """
    address = coordinator_address or os.environ.get(ENV["coordinator_address"]) or None
    n = _int_field("num_processes", num_processes)
    if n is None:
        n = _int_field("num_processes", os.environ.get(ENV["num_processes"]))
    pid = _int_field("process_id", process_id)
    if pid is None:
        pid = _int_field("process_id", os.environ.get(ENV["process_id"]))
    if address is None and n in (None, 1) and pid in (None, 0):
        return None
    if n == 0:
        address, n, pid = _detect_job(address, pid)
    if n is None or n < 1:
        raise ParameterError("distributed_num_processes",
                             f"must be given and at least 1 (0: found by JAX on a TPU "
                             f"slice) for a multi-host engine, got {n}")
    if n == 1:
        return None
    if address is None:
        raise ParameterError("distributed_coordinator_address",
                             "a multi-host engine needs the coordinator's host:port "
                             f"(flag or {ENV['coordinator_address']})")
    _split_address(address)
    if pid is None:
        raise ParameterError("distributed_process_id",
                             f"must be given (flag or {ENV['process_id']}) with "
                             f"distributed_num_processes={n}")
    if not 0 <= pid < n:
        raise ParameterError("distributed_process_id",
                             f"must be in [0, {n}) for distributed_num_processes={n}, "
                             f"got {pid}")
    return DistributedSpec(address, n, pid)


def _detect_job(address: str | None, pid: int | None) -> tuple[str | None, int, int | None]:
    """(coordinator address, process count, process id) as `jax.distributed.initialize()`
    would find them on a TPU VM slice (the given values win)."""
    try:
        from jax._src.clusters import ClusterEnv

        found = ClusterEnv.auto_detect_unset_distributed_params(address, None, pid, None,
                                                                None, 60)
    except Exception as e:  # no cluster environment here, or JAX moved its detection
        raise ParameterError("distributed_num_processes",
                             f"0 asks JAX to find the job (a TPU VM slice), which failed: "
                             f"{type(e).__name__}: {e}") from None
    if found[1] is None:
        raise ParameterError("distributed_num_processes",
                             "0 asks JAX to find the job, but this host is in no cluster "
                             "JAX knows (a TPU VM slice); give the job's flags")
    return found[0], int(found[1]), None if found[2] is None else int(found[2])


def initialize(spec: DistributedSpec) -> DistributedSpec:
    """Joins the `jax.distributed` job (once per process; before JAX's backends start)."""
    import jax

    if jax.distributed.is_initialized():
        return spec
    # Cross-process collectives between CPU devices (fake devices in tests); the
    # setting touches the CPU backend alone, so it is harmless beside an accelerator.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(spec.coordinator_address, spec.num_processes, spec.process_id)
    return spec


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free port on `host` whose successor is free too (the job's coordinator and its
    lockstep channel), for a job whose processes all run on this machine."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def agree_min(value: int) -> int:
    """The least of `value` over all processes (every process calls it at the same
    point); `value` itself in a single-process job. For sizes that must match, such as
    the KV cache's block count, which each host measures on its own device."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(value))))
