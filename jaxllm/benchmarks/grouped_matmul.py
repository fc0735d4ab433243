"""grouped-matmul: the mixture-of-experts grouped matmul bodies (layers/grouped_matmul.py)
on the Qwen3-30B-A3B expert shapes, one GPU (run as scripts/bench_grouped_matmul.py).

    PYTHONPATH=. python3 scripts/bench_grouped_matmul.py [--tokens 64,512,2048,8192]
        [--shapes gate_up,down] [--bodies pallas_gpu,ragged_dot,tiled] [--sweep]

E = 128 experts, top-8 routing, bf16: gate_up `[128, 1536, 2048]` (N=1536, K=2048) and
down `[128, 2048, 768]` (N=2048, K=768); M = 8 x tokens (token, expert) pairs. The
routing is drawn as a router would make it: top-8 of softmax(normal logits plus a
per-expert bias), so experts get uneven loads and some none. Each body is timed
(common.median_time) on the same operands and checked against a peer (ragged_dot where
it runs, else tiled, else the float32 einsum over the first rows): max |diff| over the
rows in groups, relative to the peer's largest output, must be <= 1e-2 (bf16 outputs
of float32 sums). ragged_dot computes every expert for every row, so it is skipped
past RAGGED_DOT_MAX_ROWS rows; tiled gathers one expert weight per tile, skipped where
that copy would pass TILED_MAX_BYTES.

Reported per body: microseconds, TFLOP/s of the routed FLOPs (2 M N K) and their
fraction of the bf16 matmul peak, and the fraction of the HBM roofline (each routed
expert's weight read once, the rows read and the output written), both ceilings
measured in the same run (jaxllm/benchmarks/common.py). `--sweep`: the Pallas body
also over a grid of block sizes (SWEEP, about 20 compiles per shape and M: narrow it
with --tokens / --shapes), the best printed per (shape, M). JSON to
$OUT/bench_grouped_matmul.json; a table last. `--small`: tiny shapes in Pallas
interpret mode (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import (
    measure_hbm_bandwidth,
    measure_matmul_peak,
    median_time,
    write_json,
)
from jaxllm.layers.grouped_matmul import GroupedMatmul
from pallas_kernels.grouped_matmul_gpu import gpu

EXPERTS, TOP_K = 128, 8
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}  # (N, K)
SMALL = dict(experts=8, top_k=2, shapes={"gate_up": (96, 64), "down": (64, 48)},
             tokens=(4, 32))
TOKENS = (64, 512, 2048, 8192)
BODIES = ("pallas_gpu", "ragged_dot", "tiled")
RAGGED_DOT_MAX_ROWS = 4096
TILED_MAX_BYTES = 16 << 30
TOLERANCE = 1e-2
# (bn, bk, warps, stages) beside each row tile within a factor two of the default's.
SWEEP = ((64, 64, 4, 4), (128, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 4),
         (256, 64, 8, 3), (256, 64, 8, 4), (256, 128, 8, 2))


def routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """Pairs per expert (`group_sizes`) of `tokens` tokens' top-k routing."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(tokens, experts)) + 0.5 * rng.normal(size=experts)
    ids = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    return np.bincount(ids.reshape(-1), minlength=experts).astype(np.int32)


def operands(m: int, n: int, k: int, experts: int, seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(kx, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(kw, (experts, n, k), jnp.float32) / math.sqrt(k)
           ).astype(jnp.bfloat16)
    return lhs, rhs


def skip_reason(body: str, m: int, n: int, k: int, experts: int) -> str | None:
    if body == "ragged_dot" and m > RAGGED_DOT_MAX_ROWS:
        return f"ragged_dot computes all {experts} experts per row"
    if body == "tiled":
        tm = min(128, max(8, 2 ** math.ceil(math.log2(max(1, m / experts)))))
        tiles = -(-m // tm) + min(experts, m)
        if tiles * n * k * 2 > TILED_MAX_BYTES:
            return "tiled would gather over 16 GiB of weights"
    return None


def timed(fn, *args) -> tuple[float, float, jax.Array]:
    """(seconds per call, compile seconds, output)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return median_time(compiled, *args, iters=10, reps=5), compile_s, compiled(*args)


def agreement(got: jax.Array, want: jax.Array, rows: int) -> float:
    """max |got - want| over the rows in groups, relative to want's largest."""
    g = np.asarray(got[:rows], np.float32)
    w = np.asarray(want[:rows], np.float32)
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


def figures(seconds: float, m: int, n: int, k: int, sizes: np.ndarray, bw: float,
            peak: float) -> dict:
    flops = 2.0 * int(sizes.sum()) * n * k
    nbytes = 2.0 * (int((sizes > 0).sum()) * n * k + m * k + m * n)
    return {"us": seconds * 1e6, "tflops": flops / seconds / 1e12,
            "peak_fraction": flops / peak / seconds, "hbm_fraction": nbytes / bw / seconds,
            "roofline_us": max(flops / peak, nbytes / bw) * 1e6}


def sweep(lhs, rhs, sizes_j, interpret: bool, want: jax.Array, rows: int) -> list[dict]:
    """The Pallas body over SWEEP's block sizes (configs whose tiles would not fit the
    shapes or shared memory skipped), each checked against `want` on the first `rows`
    rows; the fastest first."""
    m, k = lhs.shape
    n = rhs.shape[1]
    out = []
    default = gpu.default_block_sizes(m, n, k, rhs.shape[0])
    tiles = [t for t in (default.tm // 2, default.tm, default.tm * 2) if 16 <= t <= 128]
    for tm, (bn, bk, warps, stages) in itertools.product(tiles, SWEEP):
        # Blocks within the shapes and the pipeline's buffers within shared memory.
        if bn > max(16, n) or bk > max(16, k) or stages * (tm + bn) * bk * 2 > 200 << 10:
            continue
        b = gpu.BlockSizes(tm, bn, bk, num_warps=warps, num_stages=stages)
        config = {"tm": tm, "bn": bn, "bk": bk, "warps": warps, "stages": stages}
        try:
            s, _, got = timed(lambda x, w, g, b=b: gpu.grouped_matmul(
                x, w, g, block_sizes=b, interpret=interpret), lhs, rhs, sizes_j)
        except Exception as e:  # a config Triton rejects: reported, not fatal
            out.append({**config, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        rel = agreement(got, want, rows)
        out.append({**config, "us": s * 1e6, "max_rel_diff": rel, "agrees": rel <= TOLERANCE})
    return sorted(out, key=lambda r: r.get("us", math.inf) if r.get("agrees") else math.inf)


def run(args) -> dict:
    small = args.small
    experts = SMALL["experts"] if small else EXPERTS
    top_k = SMALL["top_k"] if small else TOP_K
    table = SMALL["shapes"] if small else SHAPES
    shapes = {s: table[s] for s in (args.shapes.split(",") if args.shapes else table)}
    tokens = (tuple(int(t) for t in args.tokens.split(",")) if args.tokens
              else SMALL["tokens"] if small else TOKENS)
    bodies = args.bodies.split(",") if args.bodies else BODIES
    bw = measure_hbm_bandwidth(0.01 if small else 2.0)
    peak = measure_matmul_peak(128 if small else 8192)
    print(f"HBM {bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    out = {"workload": "grouped-matmul", "experts": experts, "top_k": top_k,
           "hbm_bytes_per_s": bw, "bf16_flops_per_s": peak, "results": [], "sweeps": []}
    for shape, (n, k) in shapes.items():
        lhs_all, rhs = operands(top_k * max(tokens), n, k, experts)
        for t in tokens:
            m = top_k * t
            sizes = routing(t, experts, top_k)
            sizes_j, lhs = jnp.asarray(sizes), lhs_all[:m]
            outs = {}
            for body in bodies:
                row = {"shape": shape, "N": n, "K": k, "tokens": t, "M": m, "body": body,
                       "experts_hit": int((sizes > 0).sum()), "largest_group": int(sizes.max())}
                reason = skip_reason(body, m, n, k, experts)
                if reason:
                    out["results"].append({**row, "skipped": reason})
                    continue
                gmm = GroupedMatmul(body, interpret=small and body == "pallas_gpu")
                try:
                    s, compile_s, outs[body] = timed(gmm, lhs, rhs, sizes_j)
                except Exception as e:  # a body that fails to compile: the others still run
                    traceback.print_exc()
                    out["results"].append({**row, "error": f"{type(e).__name__}: {e}"[:2000]})
                    continue
                row.update(compile_s=compile_s, **figures(s, m, n, k, sizes, bw, peak))
                out["results"].append(row)
            peer_of = {b: next((p for p in ("ragged_dot", "tiled") if p in outs and p != b),
                               None) for b in outs}
            for row in out["results"]:
                if row["shape"] != shape or row["M"] != m or row["body"] not in outs:
                    continue
                peer = peer_of[row["body"]]
                if peer is None:  # the float32 einsum over the first rows' groups
                    want = _f32_reference(lhs, rhs, sizes, rows=min(m, 512))
                    rel = agreement(outs[row["body"]], want, want.shape[0])
                    peer = "float32 einsum (first rows)"
                else:
                    rel = agreement(outs[row["body"]], outs[peer], int(sizes.sum()))
                row.update(peer=peer, max_rel_diff=rel, agrees=rel <= TOLERANCE)
                print(f"{shape} M={m} {row['body']}: {row['us']:.1f} us, "
                      f"{row['tflops']:.1f} TFLOP/s ({row['peak_fraction']:.1%} of peak, "
                      f"{row['hbm_fraction']:.1%} of HBM), vs {peer}: {rel:.2e}", flush=True)
            if args.sweep:
                want = next((outs[b] for b in ("ragged_dot", "tiled", "pallas_gpu")
                             if b in outs), None)
                if want is None:
                    want = _f32_reference(lhs, rhs, sizes, rows=min(m, 512))
                configs = sweep(lhs, rhs, sizes_j, small, want, min(want.shape[0],
                                                                   int(sizes.sum())))
                out["sweeps"].append({"shape": shape, "M": m, "configs": configs})
                if configs and "us" in configs[0]:
                    print(f"{shape} M={m} best blocks: {configs[0]}", flush=True)
            write_json("bench_grouped_matmul", out)  # a cut run keeps what it measured
    return out


def _f32_reference(lhs, rhs, sizes: np.ndarray, rows: int) -> jax.Array:
    """`[rows, N]` float32: each of the first `rows` rows times its own expert's weight."""
    owner = np.searchsorted(np.cumsum(sizes), np.arange(rows), side="right")
    w = rhs[jnp.asarray(np.minimum(owner, len(sizes) - 1))].astype(jnp.float32)
    return jnp.einsum("mk,mnk->mn", lhs[:rows].astype(jnp.float32), w,
                      precision=jax.lax.Precision.HIGHEST)


def _cell(r: dict | None) -> str:
    if r is None or "us" not in r:
        return f"{'-':>28s}"
    return f"{r['us']:9.1f} us {r['tflops']:6.1f} TF {r['peak_fraction']:5.1%}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--shapes", default=None, help=f"comma-separated of {list(SHAPES)}")
    ap.add_argument("--bodies", default=None, help=f"comma-separated of {list(BODIES)}")
    ap.add_argument("--sweep", action="store_true", help="also sweep the Pallas block sizes")
    ap.add_argument("--small", action="store_true", help="tiny shapes, interpret mode (CPU)")
    out = run(ap.parse_args(argv))
    print(f"\n{'shape':8s} {'M':>6s} " + " ".join(f"{b:>28s}" for b in BODIES))
    keys = sorted({(r["shape"], r["M"]) for r in out["results"]},
                  key=lambda x: (list(SHAPES).index(x[0]) if x[0] in SHAPES else 0, x[1]))
    for shape, m in keys:
        cells = {r["body"]: r for r in out["results"] if (r["shape"], r["M"]) == (shape, m)}
        print(f"{shape:8s} {m:6d} " + " ".join(_cell(cells.get(b)) for b in BODIES))
    bad = [r for r in out["results"] if r.get("agrees") is False or "error" in r]
    print("all bodies agree" if not bad else f"DISAGREE OR FAILED: {bad}")
    return out

