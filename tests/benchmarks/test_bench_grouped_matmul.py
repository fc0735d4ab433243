"""scripts/bench_grouped_matmul.py: its routing is a top-k router's, and its CPU run
(--small) times every body, checks each against a peer and writes JSON and a table."""

import json

import numpy as np
import pytest

from jaxllm.benchmarks.grouped_matmul import SMALL, main, routing, skip_reason


def test_routing_sends_top_k_pairs_per_token_to_unevenly_loaded_experts():
    sizes = routing(64, 128, 8)
    assert sizes.shape == (128,) and sizes.dtype == np.int32
    assert sizes.sum() == 64 * 8
    assert (sizes == 0).any() and sizes.max() > 2 * sizes.mean()


def test_ragged_dot_is_skipped_past_its_row_bound_and_the_pallas_body_never():
    assert skip_reason("ragged_dot", 8 * 512, 1536, 2048, 128) is None
    assert "all 128 experts" in skip_reason("ragged_dot", 8 * 2048, 1536, 2048, 128)
    assert skip_reason("pallas_gpu", 8 * 8192, 1536, 2048, 128) is None


@pytest.mark.slow
def test_bench_grouped_matmul_small_run_writes_json_and_table(tmp_path, monkeypatch, capsys):
    """pallas_gpu against tiled, tiled against the float32 einsum, and the block sweep."""
    monkeypatch.setenv("OUT", str(tmp_path))
    main(["--small", "--bodies", "pallas_gpu,tiled", "--shapes", "gate_up", "--sweep"])
    with open(tmp_path / "bench_grouped_matmul.json") as f:
        result = json.load(f)
    assert result["workload"] == "grouped-matmul" and result["bf16_flops_per_s"] > 0
    got = {(r["M"], r["body"]): r for r in result["results"]}
    ms = [SMALL["top_k"] * t for t in SMALL["tokens"]]
    assert set(got) == {(m, b) for m in ms for b in ("pallas_gpu", "tiled")}
    for (_, body), r in got.items():
        assert r["agrees"] and r["us"] > 0 and 0 < r["peak_fraction"]
        assert r["peer"] == ("tiled" if body == "pallas_gpu" else "float32 einsum (first rows)")
    assert [s["M"] for s in result["sweeps"]] == ms
    assert all(s["configs"][0]["agrees"] for s in result["sweeps"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "all bodies agree"
    assert lines[-2].startswith("gate_up") and lines[-2].count(" us ") == 2
