"""fp8-gemm: the Llama-3-8B projections' products at each row count M, bf16 against FP8
W8A8 and FP8 weight-only, to pick `FP8_WEIGHT_ONLY_TOKENS` (layers/quant.py).

    PYTHONPATH=. python3 scripts/bench_fp8_gemm.py [--rows 1,8,...] [--shapes qkv,o]

Each product is the engine's own: bf16 `UnquantizedLinear`'s einsum, W8A8
`Fp8Linear.w8a8_product` (the per-token activation quantization included), and
`weight_only_product` (e4m3 weights upcast as the dot's operand); up to
REDUCE_ROWS rows also weight-only as a multiply and sum, no dot (an alternative
formulation the engine does not run); on the
weights' engine layouts (qkv `[8, 6, 128, 4096]`, o `[4096, 32, 128]` over
two input axes, gate_up `[2, 14336, 4096]`, down `[4096, 14336]`). One jitted
program runs the product over `copies` distinct weights (and inputs) back to
back, enough bytes that the L2 cache holds none of them and the host's launch
is amortized; the time per product is the median (common.median_time) over
`copies`. Each is reported against its HBM roofline (the weight's bytes, scales
included, at the bandwidth the same run measures) and its compute roofline
(2 M K N at the measured bf16, or for W8A8 fp8, matmul peak), with the
program's compile time and its kernel count (compiled HLO instructions that
run as kernels: fusions, custom calls) and whether any kernel writes the
upcast weight to memory (the upcast not fused into the GEMM).
JSON to $OUT/bench_fp8_gemm.json, rewritten after each shape (compiles dominate the
run: `--shapes` / `--rows` split it); a table last. `--small`: tiny shapes, a CPU check.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.benchmarks.common import (
    measure_hbm_bandwidth,
    measure_matmul_peak,
    median_time,
    write_json,
)
from jaxllm.layers.quant import Fp8Linear, einsum_spec, quantize_traced, weight_only_product

# name -> (weight's output axes, input axes), as the 8B's Linear layers hold them.
SHAPES = {"qkv": ((8, 6, 128), (4096,)), "o": ((4096,), (32, 128)),
          "gate_up": ((2, 14336), (4096,)), "down": ((4096,), (14336,))}
SMALL_SHAPES = {"qkv": ((2, 4, 16), (64,)), "o": ((64,), (4, 16)),
                "gate_up": ((2, 96), (64,)), "down": ((64,), (96,))}
ROWS = (1, 8, 32, 64, 128, 256, 1024)
SMALL_ROWS = (1, 8, 32)
VARIANTS = ("bf16", "w8a8", "weight_only")
# Weight-only as a multiply and a float32 sum over the input axes instead of a dot
# (an alternative for a few rows, where a GEMM's tiles are mostly padding).
REDUCE, REDUCE_ROWS = "weight_only_reduce", 8
W8A8 = Fp8Linear(weight_only_tokens=0)
_NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def product(variant: str, in_dims: int):
    """`(x, w, scale) -> [M, *out]` bf16, as the engine computes it."""
    if variant == "bf16":
        return lambda x, w, s: jnp.einsum(einsum_spec(in_dims, w.ndim), x, w)
    if variant == "w8a8":
        return lambda x, w, s: W8A8.w8a8_product(x, w, s, in_dims)
    if variant == REDUCE:
        def reduce(x, w, s):
            outs = w.ndim - in_dims
            xb = x.reshape(x.shape[0], *([1] * outs), *x.shape[1:])
            axes = tuple(range(1 + outs, 1 + w.ndim))
            out = jnp.sum(xb * w.astype(x.dtype), axis=axes, dtype=jnp.float32)
            return (out * s).astype(x.dtype)
        return reduce
    return lambda x, w, s: weight_only_product(x, w, s, in_dims)


def weights(out_shape: tuple, in_shape: tuple, copies: int, seed: int = 0
            ) -> tuple[list, list, list]:
    """`copies` bf16 weights and their e4m3 quantizations (weights, scales)."""
    bf16, fp8, scales = [], [], []
    for i in range(copies):
        w = 0.02 * jax.random.normal(jax.random.key(seed + i), (*out_shape, *in_shape))
        q, s = quantize_traced(W8A8, w, len(in_shape))
        bf16.append(w.astype(jnp.bfloat16))
        fp8.append(q)
        scales.append(s)
    return bf16, fp8, scales


def program_facts(compiled: Any, out_shape: tuple, in_shape: tuple, copies: int) -> dict:
    """Kernels per product in a compiled program's entry computation, and whether one
    of them writes a bf16 / f16 / f32 array of the weight's size (an unfused upcast)."""
    text = compiled.as_text() or ""
    start = text.find("\nENTRY")
    entry = text[start:text.find("\n}", start)] if start >= 0 else ""
    size = math.prod(out_shape) * math.prod(in_shape)
    kernels, written = 0, False
    for result, op in re.findall(r"=\s*(\([^=]*?\)|\S+)\s+([\w-]+)\(", entry):
        if op in _NOT_KERNELS:
            continue
        kernels += 1
        for _, dims in re.findall(r"(bf16|f16|f32)\[([\d,]*)\]", result):
            written |= bool(dims) and math.prod(int(d) for d in dims.split(",")) == size
    return {"kernels": kernels / copies, "materializes_weight": written}


def measure(variant: str, m: int, out_shape: tuple, in_shape: tuple, ws: dict,
            target_bytes: float) -> dict:
    """One variant at M = m: time per product, compile seconds, program facts."""
    w, s = ws["bf16" if variant == "bf16" else "fp8"], ws["scale"]
    per_copy = w[0].size * w[0].dtype.itemsize
    copies = max(1, min(len(w), math.ceil(target_bytes / per_copy)))
    xs = [jax.random.normal(jax.random.key(100 + i), (m, *in_shape), jnp.bfloat16)
          for i in range(copies)]
    one = product(variant, len(in_shape))
    fn = jax.jit(lambda xs, w, s: [one(x, wi, si) for x, wi, si in zip(xs, w, s, strict=True)])
    args = (xs, w[:copies], s[:copies])
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    seconds = median_time(compiled, *args, iters=5, reps=5) / copies
    return {"seconds": seconds, "copies": copies, "compile_s": compile_s,
            **program_facts(compiled, out_shape, in_shape, copies)}


def run(shapes: dict, rows: tuple, bw: float, peaks: dict, target_bytes: float) -> list:
    results = []
    for name, (out_shape, in_shape) in shapes.items():
        k, n = math.prod(in_shape), math.prod(out_shape)
        fp8_bytes = k * n + 4 * n  # the weight and its float32 channel scales
        most = max(1, min(16, math.ceil(target_bytes / fp8_bytes)))
        bf16, fp8, scales = weights(out_shape, in_shape, most)
        ws = {"bf16": bf16, "fp8": fp8, "scale": scales}
        for m in rows:
            for variant in VARIANTS + ((REDUCE,) if m <= REDUCE_ROWS else ()):
                r = measure(variant, m, out_shape, in_shape, ws, target_bytes)
                nbytes = 2 * k * n if variant == "bf16" else fp8_bytes
                peak = peaks["fp8" if variant == "w8a8" else "bf16"]  # reduce: not a GEMM
                r.update(shape=name, K=k, N=n, M=m, variant=variant, weight_bytes=nbytes,
                         us=r["seconds"] * 1e6,
                         hbm_fraction=nbytes / bw / r["seconds"],
                         compute_fraction=2 * m * k * n / peak / r["seconds"])
                results.append(r)
                print(f"{name} M={m} {variant}: {r['us']:.1f} us, {r['hbm_fraction']:.1%} "
                      f"of HBM, compile {r['compile_s']:.1f} s", flush=True)
        del bf16, fp8, scales, ws
    return results


def suggested_threshold(results: list, rows: tuple) -> int:
    """The largest M up to which weight-only, summed over the shapes, is no slower than
    W8A8 at every M (0: W8A8 wins already at the smallest)."""
    best = 0
    for m in sorted(rows):
        total = {v: sum(r["seconds"] for r in results if r["M"] == m and r["variant"] == v)
                 for v in ("w8a8", "weight_only")}
        if total["weight_only"] > total["w8a8"]:
            break
        best = m
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="comma-separated M (default: all)")
    ap.add_argument("--shapes", default=None, help=f"comma-separated of {list(SHAPES)}")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU check)")
    args = ap.parse_args(argv)
    table = SMALL_SHAPES if args.small else SHAPES
    shapes = {k: table[k] for k in (args.shapes.split(",") if args.shapes else table)}
    rows = tuple(int(m) for m in args.rows.split(",")) if args.rows else (
        SMALL_ROWS if args.small else ROWS)
    bw = measure_hbm_bandwidth(0.01 if args.small else 2.0)
    n = 128 if args.small else 8192
    peaks = {"bf16": measure_matmul_peak(n), "fp8": measure_matmul_peak(n, "float8_e4m3fn")}
    out = {"workload": "fp8-gemm", "hbm_bytes_per_s": bw, "bf16_flops_per_s": peaks["bf16"],
           "fp8_flops_per_s": peaks["fp8"], "results": []}
    for name, shape in shapes.items():  # written after each shape: a cut run keeps its part
        # Weights rotated per program: past the H100's 50 MB L2 several times over.
        out["results"] += run({name: shape}, rows, bw, peaks,
                              1 << 20 if args.small else 256 << 20)
        out["suggested_weight_only_tokens"] = suggested_threshold(out["results"], rows)
        write_json("bench_fp8_gemm", out)
    print(f"\nHBM {bw / 1e12:.2f} TB/s, bf16 {peaks['bf16'] / 1e12:.0f} TFLOP/s, "
          f"fp8 {peaks['fp8'] / 1e12:.0f} TFLOP/s; us (fraction of the HBM roofline)")
    columns = VARIANTS + (REDUCE,)
    print(f"{'shape':8s} {'M':>5s} " + " ".join(f"{v:>20s}" for v in columns))
    for name in shapes:
        for m in rows:
            cells = {r["variant"]: r for r in out["results"] if r["shape"] == name and r["M"] == m}
            print(f"{name:8s} {m:5d} " + " ".join(
                f"{cells[v]['us']:11.1f} ({cells[v]['hbm_fraction']:6.1%})" if v in cells
                else f"{'-':>20s}" for v in columns))
    print(f"weight-only no slower than W8A8 up to M = {out['suggested_weight_only_tokens']}")
    return out
