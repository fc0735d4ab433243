"""Which devices each data-parallel engine core owns.

With `data_parallel_size = dp` the server runs dp engine cores, each a full
replica on its own `tp` devices: core `r` owns devices `[r*tp, (r+1)*tp)`.
The frontend lays the cores out (`core_placements`) and each core process
takes its place (`enter_placement`) before JAX starts. On a TPU VM the core's
process is given only its own chips through libtpu's environment (tpu_dp.py),
since libtpu opens every chip it is not told to leave alone; on GPU it sees
only its own GPUs (`CUDA_VISIBLE_DEVICES`, since JAX takes memory on every GPU
it sees); on the CPU (tests, fake devices) every process sees all of them and
takes its slice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxllm.distributed.tpu_dp import detect_tpu_host, tpu_core_envs
from jaxllm.errors import ParameterError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorePlacement:
    """One engine core's place among the data-parallel replicas."""

    rank: int
    data_parallel_size: int
    tensor_parallel_size: int
    env: dict[str, str] = field(default_factory=dict)  # set in the core before JAX starts


def core_placements(data_parallel_size: int, tensor_parallel_size: int,
                    environ: Mapping[str, str] | None = None) -> list[CorePlacement]:
    """Every core's place, laid out in the frontend (which never starts JAX itself).

    On a TPU VM each place carries the libtpu environment that gives the core its
    own chips; a layout the host cannot hold raises a ParameterError naming the field.
    """
    dp, tp = data_parallel_size, tensor_parallel_size
    host = detect_tpu_host(environ) if dp > 1 else None
    envs = tpu_core_envs(host, dp, tp, environ) if host is not None else [{}] * dp
    return [CorePlacement(r, dp, tp, env) for r, env in enumerate(envs)]


def enter_placement(placement: CorePlacement) -> None:
    """Takes the core's place in its own process; call before JAX starts."""
    os.environ.update(placement.env)
    if placement.env:
        logger.info("data-parallel core %d of %d: %s", placement.rank,
                    placement.data_parallel_size,
                    " ".join(f"{k}={os.environ.get(k)}" for k in sorted(placement.env)))
    restrict_visible_gpus(placement)


def restrict_visible_gpus(placement: CorePlacement) -> None:
    """Narrows `CUDA_VISIBLE_DEVICES` to the core's GPUs; call before JAX starts.

    The GPUs are counted within those the frontend sees (its own
    `CUDA_VISIBLE_DEVICES`, else all). Harmless where there is no GPU.
    """
    dp, tp, r = placement.data_parallel_size, placement.tensor_parallel_size, placement.rank
    if dp == 1:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return  # GPUs hidden on purpose: the core runs wherever JAX falls back to
    ids = visible.split(",") if visible else [str(i) for i in range(dp * tp)]
    if len(ids) < dp * tp:
        raise ParameterError(
            "data_parallel_size",
            f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs, but "
            f"CUDA_VISIBLE_DEVICES names {len(ids)}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[r * tp:(r + 1) * tp])


def core_devices(tensor_parallel_size: int, data_parallel_size: int = 1,
                 data_parallel_rank: int = 0,
                 devices: Sequence[Any] | None = None) -> list:
    """The devices of engine core `data_parallel_rank` (all visible ones when dp is 1)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    dp, tp, r = data_parallel_size, tensor_parallel_size, data_parallel_rank
    if dp == 1:
        return job_share(devices, tp)
    platform = devices[0].platform if devices else "none"
    if platform == "tpu" and len(devices) != tp:
        raise ParameterError(
            "data_parallel_size",
            f"data_parallel_size={dp}: engine core {r} sees {len(devices)} TPU devices, "
            f"not its own {tp} chips; jaxllm gives each core its chips when it detects a "
            "TPU VM (see jaxllm/distributed/tpu_dp.py: JAXLLM_TPU_HOST names the host)")
    if platform in ("gpu", "tpu") and len(devices) == tp:
        return devices  # the core's process was left only its own GPUs or chips
    if len(devices) >= dp * tp:
        return devices[r * tp:(r + 1) * tp]
    raise ParameterError(
        "data_parallel_size",
        f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} devices, but "
        f"engine core {r} sees {len(devices)} {platform} device(s)")


def job_share(devices: Sequence[Any], tensor_parallel_size: int) -> list:
    """The devices of a mesh of `tensor_parallel_size` devices: the first of them in a
    single process, and in a job of several processes (distributed/multihost.py) an
    equal share of each process's devices, since every process runs the same programs
    and must hold part of the mesh."""
    devices = list(devices)
    procs = sorted({getattr(d, "process_index", 0) for d in devices})
    if len(procs) == 1:
        return devices
    tp, n = tensor_parallel_size, len(procs)
    if tp % n:
        raise ParameterError("tensor_parallel_size",
                             f"tensor_parallel_size={tp} does not divide over the job's {n} "
                             "processes, each of which must hold an equal part of the mesh")
    share = []
    for p in procs:
        own = [d for d in devices if getattr(d, "process_index", 0) == p]
        if len(own) < tp // n:
            raise ParameterError("tensor_parallel_size",
                                 f"tensor_parallel_size={tp} needs {tp // n} devices in each of "
                                 f"the job's {n} processes, but process {p} has {len(own)}")
        share += own[:tp // n]
    return share
