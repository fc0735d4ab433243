"""Tensor parallelism as one process per device on this host, as vLLM's workers: the
benchmark's engine core is process 0 of a `jax.distributed` job on local device 0, and
device i is driven by a `jaxllm serve` follower (engine/lockstep.py), so each process
launches its own device's programs. JAX gives each process its device through
`JAX_LOCAL_DEVICE_IDS` (GPUs stay visible to NCCL); on the CPU every process has its own
fake devices and the mesh takes one of each (`dp_devices.job_share`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from jaxllm.distributed.multihost import free_port_pair

# How the benchmark's own process holds device memory for its probes: allocated on use
# and returned on delete, so that the engine's processes find the devices' memory free.
PROBE_ALLOCATOR = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                   "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}


def release_probe_memory() -> None:
    """Sets PROBE_ALLOCATOR for this process; call before JAX starts its backend."""
    os.environ.update(PROBE_ALLOCATOR)


@contextlib.contextmanager
def worker_processes(tp: int, log_dir: str) -> Iterator[dict]:
    """Starts devices 1..tp-1's followers and yields the engine keywords of process 0
    (`LLM(..., **job)`); the engine core started inside the block takes device 0. On
    leaving, waits for the followers (they exit when process 0's engine shuts down)."""
    port = free_port_pair()
    address = f"127.0.0.1:{port}"
    saved = {k: os.environ.pop(k) for k in [*PROBE_ALLOCATOR, "JAX_LOCAL_DEVICE_IDS"]
             if k in os.environ}
    followers = []
    try:
        for i in range(1, tp):
            log = open(os.path.join(log_dir, f"follower{i}.log"), "w")  # noqa: SIM115
            followers.append(subprocess.Popen(
                [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve",
                 "--distributed-coordinator-address", address,
                 "--distributed-num-processes", str(tp), "--distributed-process-id", str(i)],
                env={**os.environ, "JAX_LOCAL_DEVICE_IDS": str(i)},
                stdout=log, stderr=subprocess.STDOUT))
            log.close()
        os.environ["JAX_LOCAL_DEVICE_IDS"] = "0"  # the engine core's process inherits it
        yield {"distributed_coordinator_address": address,
               "distributed_num_processes": tp, "distributed_process_id": 0}
        for p in followers:
            p.wait(120)
    finally:
        for p in followers:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        os.environ.pop("JAX_LOCAL_DEVICE_IDS", None)
        os.environ.update(saved)
