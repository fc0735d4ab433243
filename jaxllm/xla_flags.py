"""The XLA flags the engine's step programs want on NVIDIA GPUs, added to `XLA_FLAGS`
before JAX starts its backend (XLA reads the variable once).

A decode step is hundreds of small kernels, and XLA's runtime launches them from the
calling thread. With XLA's default command buffers (CUDA graphs) the graphs stop at
every collective and at loops, so under tensor parallelism a step was launched in
dozens of pieces, one device after another, and the host, not the GPUs, set the
step time. Recording collectives, loops and conditionals into the graphs, down to
single-kernel regions, lets a step launch in a few graph launches (BENCHMARKS.md,
"Several GPUs", has the host launch time per step before and after).

XLA's GPU rematerialization pass is off. It limits a program's memory to 80% of the
device's less the program's arguments and results; a serving step's arguments are the
weights and a KV cache sized to fill the memory, so that limit is zero and the pass
recomputes whatever it can (a decode step of a mixture-of-experts model ran its QKV
projection twice a layer). The engine bounds a step's transient memory itself
(`worker/kv_cache.activation_reserve`), so the pass only costs time.

Only where a CUDA plugin of JAX is installed; a flag the user already sets wins, and
`JAXLLM_XLA_FLAGS=0` leaves `XLA_FLAGS` alone.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

GPU_FLAGS = (
    "--xla_gpu_enable_command_buffer=+COLLECTIVES,+WHILE,+CONDITIONAL",
    "--xla_gpu_graph_min_graph_size=1",
    "--xla_disable_hlo_passes=rematerialization",
)
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def has_cuda_plugin() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def add_gpu_xla_flags(environ: MutableMapping[str, str] = os.environ,
                      gpu: bool | None = None) -> list[str]:
    """Appends each of GPU_FLAGS that `XLA_FLAGS` does not already name; the flags added."""
    if environ.get("JAXLLM_XLA_FLAGS", "1") == "0":
        return []
    if not (has_cuda_plugin() if gpu is None else gpu):
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [f for f in GPU_FLAGS if f.split("=", 1)[0] not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
