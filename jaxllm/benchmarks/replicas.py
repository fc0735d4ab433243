"""Data parallelism for the benchmarks: N independent replicas of the whole benchmark.

`--data-parallel-size N` runs N child processes of the same benchmark, each
pinned to its own `tp` GPUs through CUDA_VISIBLE_DEVICES and each taking its
1/N of the requests. Each replica runs the same engine core on the same devices
as the engine's own `data_parallel_size` would (engine/dp_client.py); the
benchmarks keep their own replicas because their roofline, padding and
host-time figures read the in-process model runner's step log, which under the
engine's data parallelism lives in the core processes. The children load, compile and warm up
at their own pace, then wait at a barrier; the parent releases them together and
the run's time is the slowest replica's. Each child prints its result as one
`REPLICA_RESULT {json}` line; the parent merges them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

_READY = "REPLICA_READY"
_RESULT = "REPLICA_RESULT "


def parse_replica(spec: str | None) -> tuple[int, int]:
    """`--replica R/N` -> (R, N); (0, 1) when the process is no replica."""
    if spec is None:
        return 0, 1
    rank, count = (int(x) for x in spec.split("/"))
    if not 0 <= rank < count:
        raise ValueError(f"--replica: rank {rank} out of 0..{count - 1}")
    return rank, count


def replica_share(items: list, spec: str | None) -> list:
    """This replica's requests: every N-th, from its rank on."""
    rank, count = parse_replica(spec)
    return items[rank::count]


def replica_devices(rank: int, tp: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for replica `rank`: its `tp` consecutive entries of the
    parent's list (or of 0, 1, ... where the parent sets none)."""
    ids = visible.split(",") if visible else [str(i) for i in range(tp * (rank + 1))]
    mine = ids[rank * tp:(rank + 1) * tp]
    if len(mine) < tp:
        raise ValueError(f"--data-parallel-size: replica {rank} needs GPUs "
                         f"{rank * tp}..{(rank + 1) * tp - 1}, but CUDA_VISIBLE_DEVICES "
                         f"lists only {len(ids)}")
    return ",".join(mine)


def barrier(spec: str | None) -> None:
    """In a replica: say it is ready and wait for the parent's go; elsewhere nothing."""
    if spec is None:
        return
    print(_READY, flush=True)
    if not sys.stdin.readline():
        raise RuntimeError("the data-parallel parent went away before the go")


def report(spec: str | None, result: dict[str, Any]) -> bool:
    """In a replica: hand `result` to the parent (True); elsewhere False."""
    if spec is None:
        return False
    print(_RESULT + json.dumps(result), flush=True)
    return True


def run_replicas(module: str, argv: list[str], dp: int, tp: int,
                 extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs `python -m module argv` as `dp` replicas and returns their results, by rank.

    argparse takes a flag's last value, so the appended `--data-parallel-size 1`
    overrides the parent's in each child.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    procs = []
    try:
        for rank in range(dp):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": replica_devices(rank, tp, visible)}
            cmd = [sys.executable, "-m", module, *argv, *(extra or []),
                   "--data-parallel-size", "1", "--replica", f"{rank}/{dp}"]
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
        for rank, p in enumerate(procs):
            while (line := p.stdout.readline()) and line.strip() != _READY:
                sys.stdout.write(f"[replica {rank}] {line}")
            if not line:
                raise RuntimeError(f"replica {rank} exited ({p.wait()}) before its warm-up "
                                   "finished; its error is above")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.close()
        results = []
        for rank, p in enumerate(procs):
            out = p.stdout.read()  # the same buffered reader as the readiness lines
            p.wait()
            found = []
            for line in out.splitlines():
                if line.startswith(_RESULT):
                    found.append(json.loads(line[len(_RESULT):]))
                else:
                    print(f"[replica {rank}] {line}")
            if p.returncode != 0 or not found:
                raise RuntimeError(f"replica {rank} failed (exit {p.returncode}); its "
                                   "error is above")
            results.append(found[0])
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
