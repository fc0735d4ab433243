"""TPU slices described without a TPU: compile-only devices for ahead-of-time compilation.

With libtpu installed, `jax.experimental.topologies.get_topology_desc` describes a
slice such as "v5e:2x2" on any host; a `Mesh` over its devices lets
`jax.jit(f).lower(...).compile()` run the real TPU compiler (Mosaic included)
with no chip attached. Those devices cannot report memory, so the HBM per chip
comes from the table below (the chips' published capacities).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re

import jax

from jaxllm.errors import ParameterError

GiB = 1 << 30

# name in a topology -> (device_kind, HBM bytes per chip, cores per chip counted by
# accelerator-type names, chips per host)
_GENERATIONS = {
    "v4": ("TPU v4", 32 * GiB, 2, 4),
    "v5e": ("TPU v5 lite", 16 * GiB, 1, 8),
    "v5p": ("TPU v5", 95 * GiB, 2, 4),
    "v6e": ("TPU v6 lite", 32 * GiB, 1, 8),
}
_ACCELERATOR_PREFIX = {"v4": "v4", "v5e": "v5litepod", "v5p": "v5p", "v6e": "v6e"}
_NAME = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A parsed topology name: generation, chip grid, and per-chip HBM."""

    name: str
    generation: str
    dims: tuple[int, int, int]
    device_kind: str
    hbm_bytes_per_chip: int

    @property
    def num_chips(self) -> int:
        return math.prod(self.dims)

    @property
    def accelerator_type(self) -> str:
        """The slice's accelerator-type name as a TPU VM reports it (e.g. v5litepod-4)."""
        cores = _GENERATIONS[self.generation][2] * self.num_chips
        return f"{_ACCELERATOR_PREFIX[self.generation]}-{cores}"


def libtpu_available() -> bool:
    """Whether the TPU compiler (the libtpu wheel) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def parse_topology(name: str) -> TpuSlice:
    """`"v5e:2x2"` -> TpuSlice; a clear error naming `tpu_topology` otherwise."""
    m = _NAME.match(name.strip())
    if m is None:
        raise ParameterError("tpu_topology", f"expected <generation>:<X>x<Y>[x<Z>] with "
                             f"generation one of {sorted(_GENERATIONS)} (e.g. v5e:2x2), "
                             f"got {name!r}")
    gen = m.group(1)
    dims = tuple(int(g) for g in m.groups()[1:] if g is not None)
    if gen in ("v4", "v5p") and len(dims) != 3:
        raise ParameterError("tpu_topology", f"{gen} slices are 3-D (e.g. {gen}:2x2x1), "
                             f"got {name!r}")
    if gen in ("v5e", "v6e") and len(dims) != 2:
        raise ParameterError("tpu_topology", f"{gen} slices are 2-D (e.g. {gen}:2x2), "
                             f"got {name!r}")
    if min(dims) < 1:
        raise ParameterError("tpu_topology", f"every dimension must be >= 1, got {name!r}")
    dims3 = (dims + (1,))[:3]
    kind, hbm, _, _ = _GENERATIONS[gen]
    return TpuSlice(name.strip(), gen, dims3, kind, hbm)


@functools.cache
def topology_devices(name: str) -> tuple[jax.Device, ...]:
    """Compile-only devices of the slice `name`, in one process when it fits one host."""
    if not libtpu_available():
        raise ParameterError("tpu_topology", "compiling for a TPU needs the TPU compiler: "
                             "pip install 'jax[tpu]' (the libtpu wheel)")
    tpu_slice = parse_topology(name)
    # libtpu asks the environment for the attached slice at start-up and warns when it
    # finds none; name the slice being compiled for, and skip the cloud metadata query.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", tpu_slice.accelerator_type)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu lets one process per host hold it (a lock file), which is for the chips;
    # compiling holds none, so compile steps may run side by side (pytest workers).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    kw = {}
    chips_per_host = _GENERATIONS[tpu_slice.generation][3]
    if tpu_slice.num_chips <= chips_per_host:
        # One host holds the whole slice (a v5e-8 / v6e-8 VM): one process, as served.
        kw["chips_per_host_bounds"] = tpu_slice.dims
    if tpu_slice.generation == "v4":
        kw["chip_config_name"] = "megacore"  # one device per chip, as jax uses a v4
    try:
        desc = topologies.get_topology_desc(tpu_slice.name, "tpu", **kw)
    except Exception as e:
        raise ParameterError("tpu_topology", f"libtpu rejects {name!r}: {e}") from e
    return tuple(desc.devices)


def hbm_bytes_per_device(device: jax.Device) -> int:
    """HBM of one device: its memory stats where it reports them, else the table."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # compile-only devices report nothing
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    for kind, hbm, _, _ in _GENERATIONS.values():
        if device.device_kind == kind:
            return hbm
    raise ParameterError("tpu_topology", f"no HBM size known for {device.device_kind!r}")
