"""Data parallelism on one TPU VM: which chips each engine core owns, told to libtpu.

libtpu opens every chip of the host unless told otherwise, and only one process
may hold a chip, so each data-parallel core must be given its own chips in its
environment before JAX starts its TPU backend. Core `r` of `dp` with
`tensor_parallel_size = tp` owns chips `[r*tp, (r+1)*tp)` and runs as a
one-process slice of its own:

  TPU_VISIBLE_CHIPS             the core's chip ids, e.g. "2,3"
  TPU_CHIPS_PER_PROCESS_BOUNDS  the core's chip grid: "1,1,1" (1 chip), "1,2,1" (2),
                                "2,2,1" (4), as JAX's own multi-process tests and Ray
                                give them to libtpu
  TPU_PROCESS_BOUNDS            "1,1,1": the core is the only process of its slice
  TPU_PROCESS_PORT / _ADDRESSES a port of its own (localhost:port), so that the
                                cores' TPU runtimes do not collide on one host
  CLOUD_TPU_TASK_ID             "0", its index in its one-process slice
  ALLOW_MULTIPLE_LIBTPU_LOAD    "1": libtpu's per-host lock would stop the 2nd core

Host chip grids (chip id = x + X*y, x fastest): v5e / v6e hosts of 8 chips are 2x4,
of 4 chips 2x2, of 1 chip 1x1; v4 / v5p hosts are 2x2x1 (4 chips, one JAX device
per chip: megacore). A core's ids must form a box of that grid, and its size must
be one libtpu takes per process (1, 2 or 4 chips); other layouts are refused with
a ParameterError naming the field, as are layouts over more chips than the host
has, hosts of a multi-host slice, and a TPU_VISIBLE_CHIPS set from outside.
The variable names and bounds follow JAX's own multi-process tests (its 4-chip
split of an 8-chip host is written for v6e's 2x4 chips, and notes that a v5e-8
whose chips run 4x2 may need another) and tpu-inference's per-rank chip split.

Detecting a TPU VM, without importing JAX in the frontend (it must not open the
chips), in this order:
  1. JAXLLM_TPU_HOST: "v6e:2x4", "v5e:2x2", "v5p:2x2x1", ... names the host's chips
     (the override, also what tests use); "none" says this is not a TPU host.
  2. JAX_PLATFORMS set without "tpu": not a TPU host (JAX will not use the chips).
  3. The host's PCI devices: Google's vendor id with a TPU device id, the scan JAX
     itself does at start-up to decide that it runs on a Cloud TPU VM; the device
     id gives the generation, their count the chips.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jaxllm.errors import ParameterError

OVERRIDE_ENV = "JAXLLM_TPU_HOST"
PCI_DEVICES = "/sys/bus/pci/devices"
_GOOGLE_VENDOR = "0x1ae0"
# PCI device id -> generation (v3 and tpu7x show two JAX devices per chip: not laid out)
_PCI_GENERATION = {"0x0027": "v3", "0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e",
                   "0x006f": "v6e", "0x0076": "tpu7x"}
# generation -> {chips on one host: its chip grid}
_HOST_GRIDS: dict[str, dict[int, tuple[int, int, int]]] = {
    "v5e": {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)},
    "v6e": {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)},
    "v4": {4: (2, 2, 1)},
    "v5p": {4: (2, 2, 1)},
}
# chips per core -> libtpu's per-process chip bounds
_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}
_OVERRIDE = re.compile(r"^([a-z0-9]+):(\d+)x(\d+)(?:x(\d+))?$")


@dataclass(frozen=True)
class TpuHost:
    """The TPU chips of this host: generation and grid (None where jaxllm knows none)."""

    generation: str
    num_chips: int
    dims: tuple[int, int, int] | None

    def describe(self) -> str:
        grid = "x".join(map(str, self.dims)) if self.dims else "unknown grid"
        return f"{self.generation} host of {self.num_chips} chips ({grid})"


def detect_tpu_host(environ: Mapping[str, str] | None = None,
                    pci_devices: str = PCI_DEVICES) -> TpuHost | None:
    """This host's TPU chips, or None where JAX will not run on TPU chips here."""
    env = os.environ if environ is None else environ
    override = env.get(OVERRIDE_ENV, "").strip()
    if override:
        return None if override.lower() == "none" else parse_host(override)
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").lower().split(",")]
    if any(platforms) and "tpu" not in platforms:
        return None
    return _scan_pci(Path(pci_devices))


def parse_host(name: str) -> TpuHost:
    """`"v6e:2x4"` -> the host it names; a ParameterError naming JAXLLM_TPU_HOST otherwise."""
    m = _OVERRIDE.match(name.strip().lower())
    if m is not None:
        dims = tuple(int(g) for g in m.groups()[1:] if g is not None)
        dims = (dims + (1,))[:3]
        if dims in _HOST_GRIDS.get(m.group(1), {}).values():
            return TpuHost(m.group(1), math.prod(dims), dims)
    known = ", ".join(f"{g}:{'x'.join(map(str, d))}" for g, grids in _HOST_GRIDS.items()
                      for d in grids.values())
    raise ParameterError(OVERRIDE_ENV, f"expected one TPU host's chip grid, one of {known}, "
                         f"or 'none'; got {name!r}")


def _scan_pci(root: Path) -> TpuHost | None:
    generations = []
    for vendor in sorted(root.glob("*/vendor")):
        try:
            if vendor.read_text().strip() != _GOOGLE_VENDOR:
                continue
            device = (vendor.parent / "device").read_text().strip()
        except OSError:
            continue
        if device in _PCI_GENERATION:
            generations.append(_PCI_GENERATION[device])
    if not generations:
        return None
    generation, n = generations[0], len(generations)
    return TpuHost(generation, n, _HOST_GRIDS.get(generation, {}).get(n))


def rank_chips(host: TpuHost, data_parallel_size: int, tensor_parallel_size: int,
               environ: Mapping[str, str] | None = None) -> list[list[int]]:
    """Each core's chip ids, core by core; a ParameterError naming the field where the
    cores cannot be laid out on this host's chips."""
    env = os.environ if environ is None else environ
    dp, tp = data_parallel_size, tensor_parallel_size
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        raise ParameterError("data_parallel_size", f"data_parallel_size={dp} runs on one TPU "
                             f"VM, but this one is a host of a {len(hosts)}-host slice "
                             "(TPU_WORKER_HOSTNAMES)")
    if env.get("TPU_VISIBLE_CHIPS", "").strip():
        raise ParameterError("data_parallel_size", f"data_parallel_size={dp} gives each core "
                             "its own chips of the host, but TPU_VISIBLE_CHIPS is already set "
                             f"({env['TPU_VISIBLE_CHIPS']}); unset it")
    if host.dims is None:
        raise ParameterError("data_parallel_size", f"data_parallel_size={dp} needs the chip "
                             f"grid of this {host.describe()}, which jaxllm does not know; "
                             f"name it with {OVERRIDE_ENV} (e.g. v6e:2x4) if it is one")
    if dp * tp > host.num_chips:
        raise ParameterError("data_parallel_size",
                             f"data_parallel_size={dp} x tensor_parallel_size={tp} needs "
                             f"{dp * tp} TPU chips, but this {host.describe()} has "
                             f"{host.num_chips}")
    blocks = [list(range(r * tp, (r + 1) * tp)) for r in range(dp)]
    if tp not in _CHIP_BOUNDS or not all(_is_box(host.dims, b) for b in blocks):
        raise ParameterError("tensor_parallel_size",
                             f"tensor_parallel_size={tp} chips are not a chip grid that one "
                             f"process of this {host.describe()} can own; with "
                             f"data_parallel_size > 1 each core takes "
                             f"{', '.join(map(str, _CHIP_BOUNDS))} chips")
    return blocks


def _is_box(dims: tuple[int, int, int], chips: list[int]) -> bool:
    """Whether the chip ids fill a box of the host's grid (ids run x fastest)."""
    x_n, y_n, _ = dims
    coords = [(c % x_n, (c // x_n) % y_n, c // (x_n * y_n)) for c in chips]
    sides = [max(axis) - min(axis) + 1 for axis in zip(*coords, strict=True)]
    return math.prod(sides) == len(chips)


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on localhost now (all held open while picked)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def core_env(chips: list[int], port: int) -> dict[str, str]:
    """The environment that makes libtpu give one core process exactly `chips`."""
    return {
        "TPU_VISIBLE_CHIPS": ",".join(map(str, chips)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": _CHIP_BOUNDS[len(chips)],
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": str(port),
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
        "CLOUD_TPU_TASK_ID": "0",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }


def tpu_core_envs(host: TpuHost, data_parallel_size: int, tensor_parallel_size: int,
                  environ: Mapping[str, str] | None = None,
                  ports: list[int] | None = None) -> list[dict[str, str]]:
    """Each core's environment, core by core (ports: free ones unless given)."""
    blocks = rank_chips(host, data_parallel_size, tensor_parallel_size, environ)
    ports = free_ports(len(blocks)) if ports is None else ports
    return [core_env(chips, port) for chips, port in zip(blocks, ports, strict=True)]
