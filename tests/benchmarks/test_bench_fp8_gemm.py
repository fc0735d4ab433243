"""scripts/bench_fp8_gemm.py's CPU run (--small): every shape, row count and product is
timed, placed against its rooflines and written as JSON, with a table last."""

import json

import pytest

from jaxllm.benchmarks.fp8_gemm import SMALL_SHAPES, VARIANTS, main, suggested_threshold


def test_suggested_threshold_is_the_last_row_count_where_weight_only_keeps_up():
    def rows(m, wo, w8a8):
        return [{"M": m, "variant": "weight_only", "seconds": wo},
                {"M": m, "variant": "w8a8", "seconds": w8a8}]
    results = rows(1, 1.0, 2.0) + rows(8, 1.0, 1.0) + rows(32, 3.0, 2.0) + rows(64, 1.0, 2.0)
    assert suggested_threshold(results, (1, 8, 32, 64)) == 8
    assert suggested_threshold(rows(1, 2.0, 1.0), (1,)) == 0


@pytest.mark.slow
def test_bench_fp8_gemm_small_run_writes_json_and_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    main(["--small", "--rows", "1,8"])
    with open(tmp_path / "bench_fp8_gemm.json") as f:
        result = json.load(f)
    assert result["workload"] == "fp8-gemm" and result["hbm_bytes_per_s"] > 0
    got = {(r["shape"], r["M"], r["variant"]): r for r in result["results"]}
    assert set(got) == {(s, m, v) for s in SMALL_SHAPES for m in (1, 8) for v in VARIANTS}
    for (shape, m, variant), r in got.items():
        assert r["us"] > 0 and r["hbm_fraction"] > 0 and r["compile_s"] > 0
        assert r["weight_bytes"] == (2 if variant == "bf16" else 1) * r["K"] * r["N"] + (
            0 if variant == "bf16" else 4 * r["N"])
        # The activation quantization is kernels of its own; weight-only has none.
        if variant == "w8a8":
            assert r["kernels"] > got[(shape, m, "weight_only")]["kernels"]
    assert result["suggested_weight_only_tokens"] in (0, 1, 8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("weight-only no slower than W8A8 up to M =")
    assert lines[-2].startswith("down ") and lines[-2].count("%)") == len(VARIANTS)
