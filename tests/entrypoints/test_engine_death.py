"""A server whose engine-core process dies: /health turns 503, requests fail fast, and
the core is restarted (or, with --exit-on-engine-death, the server exits 1).

The server is started from a `--config` YAML file, which these tests also check.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
import yaml

from tests.entrypoints.server import RemoteServer, engine_core_pid, pid_alive
from tests.models.tiny_checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # servers started and killed


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("death")
    model = make_tiny_checkpoint(tmp, arch="llama")
    config = tmp / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "model": model, "dtype": "float32", "max-model-len": 256, "max_num_seqs": 4,
        "max-num-batched-tokens": 64, "block-size": 8, "token-buckets": "16,64",
        "request-buckets": [4], "served-model-name": "from-config"}))
    srv = RemoteServer(["--config", str(config), "--served-model-name", "from-cli"])
    yield srv
    srv.stop()


def test_config_file_applies_and_command_line_flags_win(server):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("from-cli", 256)]


def _greedy_ids(client) -> list[int]:
    out = client.completions.create(model="from-cli", prompt="same answer", max_tokens=8,
                                    temperature=0.0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
    return out.choices[0].model_extra["token_ids"]


def _server_children(server_pid: int) -> set[int]:
    """The live multiprocessing 'spawn' children of the server (its engine cores)."""
    return {pid for pid in _spawned_processes() if _parent(pid) == server_pid}


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


@pytest.mark.slow
def test_a_killed_engine_core_fails_requests_fast_then_is_restarted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    before = _greedy_ids(client)
    outcome: dict = {}
    started = threading.Event()

    def stream():
        try:
            for _ in client.completions.create(model="from-cli", prompt="keep going",
                                               max_tokens=240, stream=True,
                                               extra_body={"ignore_eos": True}):
                started.set()
            outcome["result"] = "finished"
        except openai.APIError as e:
            outcome["result"] = e
        outcome["at"] = time.monotonic()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    old_pid = server.engine_pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()

    while httpx.get(server.url + "/health").status_code != 503:
        assert time.monotonic() - killed_at < 1.0, "/health still 200 a second after the kill"
        time.sleep(0.02)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:  # the new core is still starting
        client.chat.completions.create(model="from-cli", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 503 and time.monotonic() - t0 < 2

    t.join(10)
    assert not t.is_alive(), "the in-flight stream hangs"
    assert isinstance(outcome["result"], openai.APIError)
    assert outcome["at"] - killed_at < 5

    deadline = time.monotonic() + 180
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, f"no restart:\n{server.logs()}"
        time.sleep(0.2)
    server.engine_pid = engine_core_pid(server.proc.pid)
    assert server.engine_pid not in (None, old_pid)
    assert _greedy_ids(client) == before
    assert not pid_alive(old_pid)
    assert _server_children(server.proc.pid) == {server.engine_pid}, "an orphan core"
    assert server.proc.poll() is None


@pytest.mark.slow
def test_exit_on_engine_death_ends_the_server_with_status_1(tmp_path):
    """vLLM's behaviour: no restart; the server exits non-zero for its orchestrator."""
    model = make_tiny_checkpoint(tmp_path, arch="llama")
    # The module server's engine settings: its programs are in the compilation cache.
    srv = RemoteServer([model, "--dtype", "float32", "--max-model-len", "256",
                        "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                        "--block-size", "8", "--token-buckets", "16,64",
                        "--request-buckets", "4", "--exit-on-engine-death"])
    try:
        engine_pid = srv.engine_pid
        assert engine_pid is not None
        os.kill(engine_pid, signal.SIGKILL)
        srv.proc.wait(timeout=60)
        assert srv.proc.returncode == 1, srv.logs()
        assert "--engine-restarts is 0" in srv.logs()
        assert not pid_alive(engine_pid)
    finally:
        srv.stop()


def test_sigkill_of_the_server_leaves_no_engine_process(tmp_path):
    """The engine core watches its parent and exits when the frontend is killed."""
    import subprocess
    import sys

    model = make_tiny_checkpoint(tmp_path, arch="llama")
    script = (
        "import sys, time\n"
        "from jaxllm.config import EngineArgs\n"
        "from jaxllm.engine.core_client import SyncMPClient\n"
        "if __name__ == '__main__':\n"
        f"    cfg = EngineArgs(model={model!r}, dtype='float32', max_model_len=64,\n"
        "                     precompile=False, max_num_seqs=4,\n"
        "                     max_num_batched_tokens=64).create_engine_config()\n"
        "    c = SyncMPClient(cfg)\n"
        "    print(c.pid, flush=True)\n"
        "    time.sleep(600)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env,
                            cwd=os.getcwd())
    try:
        engine_pid = int(proc.stdout.readline())
        assert pid_alive(engine_pid)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while pid_alive(engine_pid):
            assert time.monotonic() < deadline, "engine core outlived its parent"
            time.sleep(0.1)
    finally:
        proc.kill()


def _spawned_processes() -> set[int]:
    """Live multiprocessing 'spawn' children on this machine (engine cores among them)."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read() and pid_alive(int(pid)):
                    pids.add(int(pid))
        except OSError:
            continue
    return pids


def test_serve_with_a_bad_model_directory_exits_naming_the_field(tmp_path):
    """The engine core starts while the frontend builds its config: a bad argument must
    still end both processes with the frontend's error, not a hang or an orphan."""
    import subprocess
    import sys

    from tests.entrypoints.server import free_port

    before = _spawned_processes()
    missing = str(tmp_path / "no-such-model")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", missing, "--host",
         "127.0.0.1", "--port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert f"jaxllm serve: error: model: no model directory at '{missing}'" in out
    assert "Traceback" not in out
    deadline = time.monotonic() + 10
    while _spawned_processes() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _spawned_processes() - before, "an engine core outlived its server"
