"""Which devices each data-parallel engine core owns.

With `data_parallel_size = dp` the server runs dp engine cores, each a full
replica on its own `tp` devices: core `r` owns devices `[r*tp, (r+1)*tp)`.
On GPU the core's process sees only those (`CUDA_VISIBLE_DEVICES`, set before
JAX starts, since JAX takes memory on every GPU it sees); on the CPU (tests,
fake devices) every process sees all of them and takes its slice. TPU chips
would need per-process chip bounds, which jaxllm does not set: there a data
parallel engine is refused with an error naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxllm.errors import ParameterError


@dataclass(frozen=True)
class CorePlacement:
    """One engine core's place among the data-parallel replicas."""

    rank: int
    data_parallel_size: int
    tensor_parallel_size: int


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
        return devices
    platform = devices[0].platform if devices else "none"
    if platform == "tpu":
        raise ParameterError(
            "data_parallel_size",
            f"data_parallel_size={dp} is not supported on TPU: each core would need its "
            "own chips (TPU_VISIBLE_CHIPS and the process bounds), which jaxllm does not "
            "set; run one server per replica with those variables set instead")
    if len(devices) >= dp * tp:
        return devices[r * tp:(r + 1) * tp]
    if platform == "gpu" and len(devices) == tp:
        return devices  # CUDA_VISIBLE_DEVICES left this core only its own GPUs
    raise ParameterError(
        "data_parallel_size",
        f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} devices, but "
        f"engine core {r} sees {len(devices)} {platform} device(s)")
