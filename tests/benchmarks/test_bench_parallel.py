"""`jaxllm bench latency|throughput` at tp 1, tp 2 (also as two processes) and dp 2 on fake
CPU devices, tiny model."""

from __future__ import annotations

import json

import pytest

from jaxllm.benchmarks import workers
from jaxllm.benchmarks.replicas import parse_replica, replica_devices, replica_share
from jaxllm.entrypoints.cli import main

PROBES = ["--probe-gib", str(1 / 1024), "--probe-matmul-n", "64"]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    from tests.models.tiny_checkpoints import make_tiny_checkpoint

    monkeypatch.setenv("OUT", str(tmp_path))
    return make_tiny_checkpoint(tmp_path, arch="llama", num_key_value_heads=2)


def latency_args(model, *extra: str) -> list[str]:
    # ms/token is the difference of two timed generates over the extra tokens: with 3 of
    # them and one timing each, the CPU's jitter once made it negative; 15 and the median
    # of 3 keep it well above the noise.
    return ["bench", "latency", "--model", str(model), "--load-format", "dummy",
            "--input-len", "16", "--output-len", "16", "--num-iters", "3", *PROBES, *extra]


def throughput_args(model, *extra: str) -> list[str]:
    return ["bench", "throughput", "--model", str(model), "--load-format", "dummy",
            "--num-prompts", "8", "--input-len", "16", "--output-len", "4",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--token-buckets", "16,64",
            "--request-buckets", "8", "--hf-peer-batch-sizes", "", *PROBES, *extra]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_bench_latency_runs_at_tp_and_times_the_all_reduces_only_above_tp1(tiny, tmp_path, tp):
    assert main(latency_args(tiny, "--tensor-parallel-size", str(tp))) == 0
    with open(tmp_path / "bench_latency.json") as f:
        r = json.load(f)
    assert r["tensor_parallel_size"] == tp and r["num_devices"] == tp
    assert r["ms_per_token"] > 0 and r["roofline_ms_per_token"] > 0
    assert (r["allreduce_bus_GBps"] is None) == (tp == 1)
    if tp == 2:
        assert r["allreduce_bus_GBps"] > 0 and r["allreduce_step_us"] > 0
        # The second floor times each of the 2 x 2 layers' all-reduces at the small psum.
        assert r["floor_with_allreduce_latency_ms"] > 4 * r["allreduce_step_us"] / 1e3
    else:
        assert r["floor_with_allreduce_latency_ms"] == r["roofline_ms_per_token"]


@pytest.mark.slow
def test_bench_latency_with_worker_processes_runs_tp2_as_a_job_of_two_processes(
        tiny, tmp_path, monkeypatch):
    for name in (*workers.PROBE_ALLOCATOR, "JAX_LOCAL_DEVICE_IDS"):
        monkeypatch.setenv(name, "")  # what the run sets is undone after the test
    r = main(latency_args(tiny, "--tensor-parallel-size", "2", "--worker-processes"))
    assert r == 0
    with open(tmp_path / "bench_latency.json") as f:
        r = json.load(f)
    # The engine core drove its device as process 0 of a two-process job; the follower
    # (device 1) ran the same steps and left when the engine shut down.
    assert r["worker_processes"] and r["engine_processes"] == 2
    assert r["tensor_parallel_size"] == 2 and r["ms_per_token"] > 0
    assert r["params"] > 0 and r["allreduce_step_us"] > 0
    assert (tmp_path / "follower1.log").exists()


def test_worker_processes_need_tp_above_one_and_no_data_parallelism(tiny, capsys):
    with pytest.raises(SystemExit):
        main(latency_args(tiny, "--worker-processes"))
    assert "--worker-processes needs --tensor-parallel-size" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_bench_throughput_runs_at_tp_and_generates_every_token(tiny, tmp_path, tp):
    assert main(throughput_args(tiny, "--tensor-parallel-size", str(tp))) == 0
    with open(tmp_path / "bench_throughput.json") as f:
        r = json.load(f)
    assert r["tensor_parallel_size"] == tp and r["data_parallel_size"] == 1
    assert r["output_tokens"] == 8 * 4 and r["input_tokens"] == 8 * 16
    assert r["roofline_s"] > 0 and r["elapsed_s"] > 0
    assert (r["allreduce_bus_GBps"] is None) == (tp == 1)


@pytest.mark.slow
def test_bench_throughput_dp2_splits_the_requests_over_two_replica_processes(tiny, tmp_path):
    assert main(throughput_args(tiny, "--data-parallel-size", "2")) == 0
    with open(tmp_path / "bench_throughput.json") as f:
        r = json.load(f)
    assert r["data_parallel_size"] == 2 and r["num_devices"] == 2
    assert [x["num_prompts"] for x in r["replicas"]] == [4, 4]
    assert r["output_tokens"] == 8 * 4
    # The replicas ran at once: the run took the slowest one's time.
    assert r["elapsed_s"] == max(x["elapsed_s"] for x in r["replicas"])
    assert r["roofline_s"] == max(x["roofline_s"] for x in r["replicas"])


def test_latency_refuses_a_data_parallel_size_that_does_not_divide_the_batch(tiny, capsys):
    with pytest.raises(SystemExit):
        main(latency_args(tiny, "--data-parallel-size", "2"))
    assert "--data-parallel-size 2" in capsys.readouterr().err


def test_replicas_take_disjoint_request_shares_and_their_own_gpus():
    items = list(range(10))
    shares = [replica_share(items, f"{r}/3") for r in range(3)]
    assert sorted(sum(shares, [])) == items and [len(s) for s in shares] == [4, 3, 3]
    assert replica_share(items, None) == items and parse_replica(None) == (0, 1)
    assert replica_devices(1, 2, None) == "2,3"
    assert replica_devices(1, 1, "4,5,6") == "5"
    with pytest.raises(ValueError, match="--data-parallel-size"):
        replica_devices(2, 2, "0,1,2,3")


@pytest.mark.slow
def test_bench_throughput_with_random_loras_generates_every_token(tiny, tmp_path):
    """The CPU dry run of `--num-loras N --lora-rank R` (the device run compares it with
    the same workload without adapters)."""
    assert main(throughput_args(tiny, "--num-loras", "3", "--lora-rank", "4")) == 0
    with open(tmp_path / "bench_throughput.json") as f:
        r = json.load(f)
    assert r["num_loras"] == 3 and r["lora_rank"] == 4
    assert r["output_tokens"] == 8 * 4 and r["input_tokens"] == 8 * 16


@pytest.mark.parametrize("args", [latency_args, throughput_args])
def test_a_fixed_kv_block_count_reaches_the_engine(tiny, monkeypatch, args):
    # vLLM's fixed block count, for runs compared at one cache size.
    import jaxllm

    seen = {}

    class Stop(Exception):
        pass

    def engine(*a, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(jaxllm, "LLM", engine)
    with pytest.raises(Stop):
        main(args(tiny, "--num-gpu-blocks-override", "64"))
    assert seen["num_gpu_blocks_override"] == 64
