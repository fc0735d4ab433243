"""A real `jaxllm serve` subprocess on 127.0.0.1 for the HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# Small engine settings: compilation on a 2-core CPU is the slow part.
TINY_ENGINE_FLAGS = ["--dtype", "float32", "--max-num-batched-tokens", "64", "--block-size", "8",
                     "--token-buckets", "16,64", "--seed", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_core_pid(server_pid: int) -> int | None:
    """The spawned engine-core child of a server process (not multiprocessing's tracker)."""
    pids = engine_core_pids(server_pid)
    return pids[0] if pids else None


def engine_core_pids(server_pid: int) -> list[int]:
    """Every spawned engine-core child of a server process (one per data-parallel rank)."""
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{server_pid}/task"):
            with open(f"/proc/{server_pid}/task/{task}/children") as f:
                children += [int(p) for p in f.read().split()]
    except OSError:
        return []
    pids = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            pids.append(pid)
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


class RemoteServer:
    def __init__(self, args: list[str], startup_timeout: float = 300.0):
        self.port = free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="jaxllm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", *args,
               "--host", self.host, "--port", str(self.port), "--disable-uvicorn-access-log"]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(startup_timeout)
        self.engine_pid = engine_core_pid(self.proc.pid)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy in {timeout}s:\n{self.logs()}")

    def logs(self, tail: int = 6000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-tail:]

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: {'jaxllm:num_requests_running': 0.0, ...}."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            if 'finished_reason="' in name_labels:
                name += "[" + name_labels.split('finished_reason="', 1)[1].split('"', 1)[0] + "]"
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.engine_pid is not None and pid_alive(self.engine_pid):
            os.kill(self.engine_pid, signal.SIGKILL)  # never leave an orphan behind a test
        return self.proc.returncode
