"""`jaxllm bench`: the CPU-runnable benchmark runs end to end through the CLI."""

from __future__ import annotations

import json

import pytest

from jaxllm.entrypoints.cli import BENCHMARKS, build_parser, main


def test_bench_lists_every_benchmark_and_passes_its_flags_through():
    ns = build_parser().parse_args(["bench", "latency", "--batch-size", "4", "--num-iters", "1"])
    assert ns.benchmark == "latency" and ns.args == ["--batch-size", "4", "--num-iters", "1"]
    assert set(BENCHMARKS) == {"latency", "throughput", "prefix", "serving", "host-overhead"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nope"])


@pytest.mark.slow
def test_bench_host_overhead_runs_and_writes_json(tmp_path, monkeypatch, capsys):
    from jaxllm.sample import staged
    from jaxllm.worker import programs

    real_sampler = staged.STAGED
    monkeypatch.setenv("OUT", str(tmp_path))
    assert main(["bench", "host-overhead", "--num-requests", "16", "--input-len", "32",
                 "--steps", "5"]) == 0
    with open(tmp_path / "bench_host_overhead.json") as f:
        result = json.load(f)
    assert result["workload"] == "host-overhead" and result["num_running"] == 16
    assert 0 < result["ms_per_step_median"] <= result["ms_per_step_p90"]
    # The core's part of each step is inside the step: so are its order statistics.
    assert 0 < result["engine_core_ms_per_step_median"] <= result["ms_per_step_median"]
    assert result["host_calibration_ms_median"] > 0
    assert result["engine_core_step_over_calibration"] == pytest.approx(
        result["engine_core_ms_per_step_median"] / result["host_calibration_ms_median"])
    assert "engine core step" in capsys.readouterr().out
    # The stubbed sampler must not outlive the benchmark (later engines sample for real).
    assert staged.STAGED is real_sampler and programs.STAGED is real_sampler


@pytest.mark.slow
def test_bench_prefix_reports_cache_hits_only_for_the_shared_prefix(tmp_path, monkeypatch):
    from tests.models.tiny_checkpoints import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path, arch="llama", num_key_value_heads=2)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert main(["bench", "prefix", "--model", str(model), "--load-format", "auto",
                 "--dtype", "float32", "--prefix-len", "48", "--suffix-len", "8",
                 "--num-suffixes", "4", "--output-len", "2", "--num-iters", "1",
                 "--block-size", "8", "--max-num-batched-tokens", "64",
                 "--token-buckets", "16,64"]) == 0
    with open(tmp_path / "bench_prefix.json") as f:
        result = json.load(f)
    assert result["uncached"]["cached_token_fraction"] == 0.0
    # 48 of 56 prompt tokens are the shared prefix: 6 full blocks of 8 hit the cache.
    assert result["cached"]["cached_token_fraction"] == 48 / 56
    assert result["cached"]["ttft_ms_mean"] > 0 and result["uncached"]["ttft_ms_mean"] > 0


def test_gpu_state_flags_thermal_slowdown_but_not_the_power_cap():
    from jaxllm.benchmarks.common import gpu_state, parse_gpu_state

    # As read on a lent H100 that was overheating: SW thermal slowdown (0x20).
    hot = parse_gpu_state("1005, 1980, 86, 269.36, 0x0000000000000020")
    assert hot["sm_clock_MHz"] == 1005 and hot["temperature_C"] == 86
    assert hot["slowdowns"] == ["software thermal slowdown"]
    # At the power cap (0x4) under a full load: the normal state, no warning.
    assert parse_gpu_state("1755, 1980, 55, 699.1, 0x0000000000000004")["slowdowns"] == []
    both = parse_gpu_state("900, 1980, 90, 300.0, 0x0000000000000048")["slowdowns"]
    assert both == ["hardware slowdown", "hardware thermal slowdown"]
    import shutil

    if shutil.which("nvidia-smi") is None:
        assert gpu_state() is None  # no GPU to ask
