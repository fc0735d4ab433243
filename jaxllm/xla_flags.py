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

Command buffers are updated in `SKIP_TEMP` mode. Before each launch XLA re-records the
graph nodes whose buffers moved, and by default a step's temporary buffers move on
every call, so launching a step of a thousand small kernels cost as much host time as
the GPU spent running it. In this mode the temporaries keep fixed virtual addresses
(XLA then uses its VMM allocator, which keeps no memory statistics: the KV cache is
sized from CUDA's own free-memory count, `worker/kv_cache.gpu_memory`). Only from the
first jaxlib that was seen to take the flag: XLA aborts on a flag it does not know, and
jaxlib 0.10.2 does not know this one.

Programmatic dependent launch is on (XLA applies it from Hopper on). The kernels XLA
emits may then let the next kernel launch before they end, its launch and prologue
overlapping their tail: a decode step is a chain of short kernels, each of which
otherwise waits for the last to drain before it starts (BENCHMARKS.md, Qwen3-30B-A3B).

Only where a CUDA plugin of JAX is installed; a flag the user already sets wins, and
`JAXLLM_XLA_FLAGS=0` leaves `XLA_FLAGS` alone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import MutableMapping

GPU_FLAGS = (
    "--xla_gpu_enable_command_buffer=+COLLECTIVES,+WHILE,+CONDITIONAL",
    "--xla_gpu_graph_min_graph_size=1",
    "--xla_disable_hlo_passes=rematerialization",
    "--xla_gpu_enable_pdl=true",
)
SKIP_TEMP_FLAG = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
SKIP_TEMP_JAXLIB = (0, 11, 2)
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def has_cuda_plugin() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's release numbers (read without importing it)."""
    try:
        text = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


def gpu_flags(jaxlib: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """The flags for GPUs under jaxlib release `jaxlib` (None: the installed one)."""
    jaxlib = jaxlib_version() if jaxlib is None else jaxlib
    return GPU_FLAGS + ((SKIP_TEMP_FLAG,) if jaxlib >= SKIP_TEMP_JAXLIB else ())


def add_gpu_xla_flags(environ: MutableMapping[str, str] = os.environ,
                      gpu: bool | None = None,
                      jaxlib: tuple[int, ...] | None = None) -> list[str]:
    """Appends each of `gpu_flags(jaxlib)` that `XLA_FLAGS` does not already name; the
    flags added."""
    if environ.get("JAXLLM_XLA_FLAGS", "1") == "0":
        return []
    if not (has_cuda_plugin() if gpu is None else gpu):
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [f for f in gpu_flags(jaxlib) if f.split("=", 1)[0] not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
