"""scripts/profile_host.py on the CPU, tiny model: it runs the throughput workload's engine
(built from the throughput benchmark's own arguments) under cProfile, with an adapter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _profile_host():
    spec = importlib.util.spec_from_file_location("profile_host",
                                                  ROOT / "scripts/profile_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_profile_host_runs_the_throughput_workload_with_adapters(tmp_path, monkeypatch):
    from tests.models.tiny_checkpoints import make_tiny_checkpoint

    monkeypatch.setenv("OUT", str(tmp_path))
    model = make_tiny_checkpoint(tmp_path, arch="llama", num_key_value_heads=2)
    args = ["--model", str(model), "--load-format", "dummy", "--num-prompts", "8",
            "--input-len", "16", "--output-len", "4", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "64", "--token-buckets", "16,64",
            "--request-buckets", "8", "--num-loras", "2", "--lora-rank", "4", "--top", "3"]
    result = _profile_host().main(args)
    assert result["num_loras"] == 2 and result["num_prompts"] == 8
    assert len(result["top_cumulative"]) == 3
    assert (tmp_path / "profile_host_lora2.json").exists()
    with pytest.raises(SystemExit):
        _profile_host().main(args + ["--data-parallel-size", "2"])
