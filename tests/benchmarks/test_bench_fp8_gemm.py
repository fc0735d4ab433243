"""scripts/bench_fp8_gemm.py's CPU run (--small): every shape, row count and product is
timed, placed against its rooflines and written as JSON, with a table last."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.benchmarks.fp8_gemm import (
    REDUCE,
    SMALL_SHAPES,
    VARIANTS,
    main,
    product,
    suggested_threshold,
    weights,
)
from jaxllm.layers.quant import dequantize


@pytest.mark.parametrize("name", list(SMALL_SHAPES))
def test_benchmarked_products_compute_the_projection(name):
    """Each variant on the engine layouts against the float32 product with the weight
    it reads (bf16, or the dequantized e4m3 weight); W8A8 within e4m3's rounding of x."""
    out_shape, in_shape = SMALL_SHAPES[name]
    (wb,), (q,), (s,) = weights(out_shape, in_shape, 1)
    x = jax.random.normal(jax.random.key(3), (8, *in_shape), jnp.float32)
    xb = x.astype(jnp.bfloat16)
    n, k = math.prod(out_shape), math.prod(in_shape)
    x2 = np.asarray(xb, np.float32).reshape(8, k)
    deq = dequantize(np.asarray(q).reshape(n, k), np.asarray(s).reshape(n))
    wants = {"bf16": x2 @ np.asarray(wb, np.float32).reshape(n, k).T, "w8a8": x2 @ deq.T,
             "weight_only": x2 @ deq.T, REDUCE: x2 @ deq.T}
    for variant, want in wants.items():
        got = np.asarray(jax.jit(product(variant, len(in_shape)))(xb, wb if variant == "bf16"
                                                                 else q, s), np.float32)
        assert got.shape == (8, *out_shape)
        tol = 0.1 if variant == "w8a8" else 0.02  # bf16 output; e4m3 activations
        np.testing.assert_allclose(got.reshape(8, n), want, rtol=0,
                                   atol=tol * np.abs(want).max())


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
    assert set(got) == {(s, m, v) for s in SMALL_SHAPES for m in (1, 8)
                        for v in (*VARIANTS, REDUCE)}
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
    assert lines[-2].startswith("down ") and lines[-2].count("%)") == len(VARIANTS) + 1
