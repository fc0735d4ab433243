"""Multi-host engines: two processes on this machine, two fake CPU devices each, one
`jax.distributed` job (gloo collectives), tensor_parallel_size=4 over the 4 global devices.

Host 0 is an offline `LLM(...)` or `jaxllm serve`; host 1 is `jaxllm serve
--distributed-process-id 1`, which follows host 0 (engine/lockstep.py). Greedy
tokens must be a single process's at tp=1; a killed follower must turn the
served /health away from 200 within seconds and end the server, never hang it.
The job's flags and environment resolve as distributed/multihost.py says, bad
values naming their field.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.distributed.dp_devices import core_devices
from jaxllm.distributed.multihost import DistributedSpec, free_port_pair, resolve_distributed
from jaxllm.errors import ParameterError
from tests.entrypoints.server import RemoteServer, pid_alive

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, token_buckets=[16], request_buckets=[4], seed=0)
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "16", "--block-size", "8", "--token-buckets", "16",
                "--request-buckets", "4", "--seed", "0"]
# The demo model's vocabulary is 48 ids; the last prompt runs in two chunks of 16.
PROMPTS = [[5, 9, 13, 17, 21, 30, 41], [7, 8, 9],
           [10, 20, 30, 40, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TWO_DEVICES = "--xla_force_host_platform_device_count=2"
STARTUP_S = 400.0
JOB_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@pytest.fixture
def no_job_env(monkeypatch):
    for name in JOB_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_flags_name_the_job_and_a_lone_process_is_none(no_job_env):
    assert resolve_distributed() is None
    assert resolve_distributed(None, 1, 0) is None
    assert resolve_distributed("10.0.0.1:1234", 4, 3) == DistributedSpec("10.0.0.1:1234", 4, 3)
    assert DistributedSpec("10.0.0.1:1234", 4, 3).side_channel() == ("10.0.0.1", 1235)


def test_environment_names_the_job_and_flags_win(no_job_env):
    no_job_env.setenv("JAX_COORDINATOR_ADDRESS", "host0:7000")
    no_job_env.setenv("JAX_NUM_PROCESSES", "2")
    no_job_env.setenv("JAX_PROCESS_ID", "1")
    assert resolve_distributed() == DistributedSpec("host0:7000", 2, 1)
    assert resolve_distributed(process_id=0) == DistributedSpec("host0:7000", 2, 0)
    assert EngineArgs(distributed_process_id=0).distributed_spec() == \
        DistributedSpec("host0:7000", 2, 0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(coordinator_address="nohost", num_processes=2, process_id=0),
     "distributed_coordinator_address"),
    (dict(coordinator_address="h:99999", num_processes=2, process_id=0),
     "distributed_coordinator_address"),
    (dict(num_processes=2, process_id=0), "distributed_coordinator_address"),
    (dict(coordinator_address="h:1", num_processes="two", process_id=0),
     "distributed_num_processes"),
    (dict(coordinator_address="h:1", process_id=1), "distributed_num_processes"),
    (dict(coordinator_address="h:1", num_processes=-1, process_id=0),
     "distributed_num_processes"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), "distributed_process_id"),
    (dict(coordinator_address="h:1", num_processes=2), "distributed_process_id"),
])
def test_bad_job_values_are_errors_naming_the_field(no_job_env, kwargs, field):
    with pytest.raises(ParameterError) as e:
        resolve_distributed(**kwargs)
    assert e.value.field == field


def test_serve_reports_a_bad_job_flag_in_one_line_naming_it(no_job_env, capsys):
    from jaxllm.entrypoints.cli import main

    assert main(["serve", "--distributed-coordinator-address", "127.0.0.1:5",
                 "--distributed-num-processes", "2", "--distributed-process-id", "3"]) == 2
    assert "error: distributed_process_id: must be in [0, 2)" in capsys.readouterr().err


def test_an_engine_is_built_on_host_0_only_and_without_data_parallelism(no_job_env):
    job = dict(distributed_coordinator_address="127.0.0.1:1", distributed_num_processes=2)
    with pytest.raises(ParameterError) as e:
        EngineArgs(distributed_process_id=1, **job).create_engine_config()
    assert e.value.field == "distributed_process_id"
    with pytest.raises(ParameterError) as e:
        EngineArgs(distributed_process_id=0, data_parallel_size=2, **job).create_engine_config()
    assert e.value.field == "data_parallel_size"


class _Device:
    def __init__(self, process_index: int, id: int):
        self.process_index, self.id = process_index, id


def test_a_mesh_takes_an_equal_share_of_each_process_devices():
    two_by_four = [_Device(p, i) for p in range(2) for i in range(4)]
    assert [(d.process_index, d.id) for d in core_devices(2, 1, 0, two_by_four)] == \
        [(0, 0), (1, 0)]
    assert [(d.process_index, d.id) for d in core_devices(4, 1, 0, two_by_four)] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert core_devices(8, 1, 0, two_by_four) == two_by_four
    with pytest.raises(ParameterError, match="does not divide over the job's 2 processes"):
        core_devices(3, 1, 0, two_by_four)
    with pytest.raises(ParameterError, match="needs 4 devices in each .* process 1 has 2"):
        core_devices(8, 1, 0, two_by_four[:6])
    one_process = two_by_four[:4]
    assert core_devices(2, 1, 0, one_process) == one_process  # the mesh takes the first two


def test_host_values_go_whole_to_every_device_of_a_replicated_sharding():
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxllm.distributed.mesh import make_mesh, put_replicated

    sharding = NamedSharding(make_mesh(2), P())
    values = (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([True, False]))
    placed = put_replicated(values, sharding)
    for got, want in zip(placed, values, strict=True):
        assert isinstance(got, jax.Array) and got.sharding == sharding
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want)


def _job_flags(port: int, process_id: int) -> list[str]:
    return ["--distributed-coordinator-address", f"127.0.0.1:{port}",
            "--distributed-num-processes", "2", "--distributed-process-id", str(process_id)]


def _start_follower(port: int, log_path: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=TWO_DEVICES, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAXLLM_NO_PROGRESS="1")
    for name in JOB_ENV:
        env.pop(name, None)
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "jaxllm.entrypoints.cli", "serve",
                                 *_job_flags(port, 1)], stdout=log, stderr=subprocess.STDOUT,
                                env=env)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def single_process_tokens():
    llm = LLM(None, tensor_parallel_size=1, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_two_hosts_at_tp4_give_the_single_process_greedy_tokens(
        no_job_env, tmp_path, single_process_tokens):
    port = free_port_pair()
    follower = _start_follower(port, str(tmp_path / "follower.log"))
    try:
        # The engine core's process (spawned by LLM) sees two devices of its own.
        no_job_env.setenv("XLA_FLAGS", TWO_DEVICES)
        llm = LLM(None, tensor_parallel_size=4, distributed_coordinator_address=f"127.0.0.1:{port}",
                  distributed_num_processes=2, distributed_process_id=0, **ENGINE)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == single_process_tokens
        # Host 0's shutdown stops the follower, which exits cleanly.
        assert follower.wait(60) == 0, (tmp_path / "follower.log").read_text()[-3000:]
    finally:
        _stop(follower)


@pytest.mark.slow
def test_a_killed_follower_fails_health_within_seconds_and_ends_the_server(
        no_job_env, tmp_path, single_process_tokens):
    port = free_port_pair()
    follower = _start_follower(port, str(tmp_path / "follower.log"))
    server = None
    try:
        no_job_env.setenv("XLA_FLAGS", TWO_DEVICES)
        no_job_env.setenv("JAXLLM_NO_PROGRESS", "1")
        # Compiled on first use (the offline test covers the lockstep precompile).
        server = RemoteServer([*ENGINE_FLAGS, "--tensor-parallel-size", "4", "--no-precompile",
                               *_job_flags(port, 0)], startup_timeout=STARTUP_S)
        reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}).json()
        assert reply["choices"][0]["token_ids"] == single_process_tokens[0], reply
        follower.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = 200
        while status == 200 and time.monotonic() - killed < 10:
            try:
                status = httpx.get(server.url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                status = -1  # the server already stopped listening
            time.sleep(0.1)
        assert status != 200, "/health still 200 10s after the follower died"
        # No restart can bring a multi-host core back: the server exits, non-zero.
        assert server.proc.wait(60) != 0
        assert "a follower host disconnected" in server.logs(200_000)
        assert server.engine_pid is None or not pid_alive(server.engine_pid)
    finally:
        _stop(follower)
        if server is not None:
            server.stop(signal.SIGKILL)
