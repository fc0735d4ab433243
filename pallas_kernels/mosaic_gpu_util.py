"""Helpers shared by the Pallas Mosaic GPU (Hopper) kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Mosaic GPU is part of jax proper, but keep the kernels importable without it.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except Exception:  # pragma: no cover
    plgpu = None


@functools.cache
def is_hopper() -> bool:
    """Whether the default device is a compute-capability 9.x GPU (wgmma, TMA)."""
    try:
        dev = jax.devices()[0]
    except Exception:  # pragma: no cover
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def num_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except Exception:  # pragma: no cover
        return 132


def kernel_mode() -> str | None:
    """How tests run the Mosaic GPU kernels here: "interpret" (CPU), "device" (Hopper), None."""
    backend = jax.default_backend()
    if backend == "cpu":
        return "interpret"
    if backend == "gpu" and is_hopper():
        return "device"
    return None


def wait_last_releases(total, num_stages: int, *free_barriers) -> None:
    """A producer's last act: wait on the releases of the final `num_stages` stages of
    its ring (of `total` steps), so every phase of a "consumed" barrier is waited on
    by each thread that waits on it (the interpreter checks this)."""
    @pl.loop(jnp.maximum(total - num_stages, 0), total)
    def _drain(g):
        slot = lax.rem(g, jnp.int32(num_stages))
        for bar in free_barriers:
            plgpu.barrier_wait(bar.at[slot])
