"""Transparent huge pages under the engine core's heap.

An engine step is memory-bound Python: it walks hundreds of requests' token
lists, numpy arrays and small objects, scattered over the heap. With 4 KiB
pages that walk misses the TLB often, and under a hypervisor (nested paging)
each miss is a two-level page walk. On the H100 host's Xeon VM the host-overhead
step read either ~0.8 or ~1.3 ms per run of the same code, with the thread's CPU
time jumping alike; with the heap on 2 MiB pages every run read ~0.7-0.85 ms
(BENCHMARKS.md, host-overhead).

glibc (2.35 and later) backs malloc's arenas with transparent huge pages when
the `glibc.malloc.hugetlb=1` tunable is set (it madvises them MADV_HUGEPAGE,
which the kernel honours in its THP modes `madvise` and `always`). glibc reads
tunables once, when a process starts, so jaxllm sets it for the processes it
starts for an engine core: the server's (and multiprocess LLM's) engine core
process, and the process the host-overhead benchmark measures. Elsewhere it is
inert: an older glibc ignores the tunable, musl does not read it, THP mode
`never` declines it. `JAXLLM_MALLOC_HUGEPAGES=0` leaves the environment alone;
a `glibc.malloc.hugetlb` setting of the caller's own is kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

TUNABLE = "glibc.malloc.hugetlb"


def hugepage_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child process whose malloc puts its heap on transparent huge pages."""
    out = dict(env)
    if out.get("JAXLLM_MALLOC_HUGEPAGES", "1") == "0":
        return out
    tunables = out.get("GLIBC_TUNABLES", "")
    if TUNABLE + "=" not in tunables:
        out["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return out


@contextlib.contextmanager
def hugepage_children() -> Iterator[None]:
    """Processes started inside the block (multiprocessing's spawn inherits this
    process's environment) get `hugepage_env`; the environment is restored after."""
    want = hugepage_env(os.environ).get("GLIBC_TUNABLES")
    before = os.environ.get("GLIBC_TUNABLES")
    if want is not None:
        os.environ["GLIBC_TUNABLES"] = want
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = before


def requested_here() -> bool:
    """Whether this process's environment asks glibc for huge pages. (os.environ, a copy
    made at start-up: glibc rewrites the original in place as it parses it.)"""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(t.strip() == TUNABLE + "=1" for t in tunables.split(":"))


def anon_hugepages_kib() -> int | None:
    """KiB of this process's anonymous memory on transparent huge pages (Linux), else None."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
