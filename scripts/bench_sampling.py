"""Benchmark: sort-based vs sort-free (threshold search) top-k/top-p, and the sampler.

Batch 256 x vocab 128256 (Llama-3) float32 logits, per-row top-k in [1, 200]
(a quarter off) and top-p in [0.5, 1) (a quarter off). Each function is
jitted, warmed up, then timed `--iters` times with a block on the result;
the median is reported beside the time of one read of the logits at the HBM
bandwidth measured in the same run. Prints a table; writes JSON to
$OUT/bench_sampling.json when $OUT is set.

    PYTHONPATH=. python3 scripts/bench_sampling.py [--batch 256] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np


def _stub_msgspec_if_missing() -> None:
    """The accelerator image has jax but not the engine's other dependencies.

    Importing the sampler runs `jaxllm/__init__`, which defines msgspec
    Structs; the sampler never uses them, so a stand-in class is enough here.
    """
    try:
        import msgspec  # noqa: F401
    except ModuleNotFoundError:
        class Struct:
            def __init_subclass__(cls, **kwargs):
                super().__init_subclass__()

        sys.modules["msgspec"] = types.SimpleNamespace(
            Struct=Struct, structs=types.SimpleNamespace(replace=None))


_stub_msgspec_if_missing()
from jaxllm.sample import sampler  # noqa: E402
from jaxllm.sample.metadata import SamplingMetadata  # noqa: E402
from jaxllm.sample.rng import key_base_data  # noqa: E402
from jaxllm.sampling_params import MAX_LOGPROBS  # noqa: E402
from pallas_kernels.sampling import sort_topk, topk_topp  # noqa: E402


def time_fn(fn, args, iters: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_ms": 1e3 * statistics.median(times), "p10_ms": 1e3 * times[len(times) // 10],
            "p90_ms": 1e3 * times[(9 * len(times)) // 10], "iters": iters}


def hbm_bandwidth(iters: int, gib: float) -> float:
    """Bytes/s of a jitted `a * 2` over `gib` GiB of bf16 (read + write)."""
    n = int(gib * 2**29)
    a = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    r = time_fn(jax.jit(lambda x: x * 2), (a,), iters)
    del a
    return 2 * 2 * n / (r["median_ms"] * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bw-gib", type=float, default=2.0, help="size of the bandwidth probe")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip what is left after this")
    args = ap.parse_args()
    start = time.perf_counter()
    R, V = args.batch, args.vocab
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((R, V), np.float32) * 4)
    top_k = rng.integers(1, 201, R)
    top_k[rng.random(R) < 0.25] = 0
    top_p = rng.uniform(0.5, 1.0, R)
    top_p[rng.random(R) < 0.25] = 1.0
    top_k, top_p = jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)

    bw = hbm_bandwidth(args.iters, args.bw_gib)
    read_s = R * V * 4 / bw  # one pass over the logits
    results: dict = {
        "date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "batch": R, "vocab": V, "hbm_bytes_per_s": bw,
        "one_read_of_logits_ms": 1e3 * read_s, "rows": {}}

    sort_mask = jax.jit(sort_topk.top_k_top_p_mask)(logits, top_k, top_p)
    cases = {"sort (reference)": jax.jit(sort_topk.apply_top_k_top_p)}
    for bits in (1, 2, 4):
        cases[f"threshold, {bits} bit/round"] = jax.jit(
            lambda x, k, p, b=bits: topk_topp.apply_top_k_top_p(x, k, p, bits_per_round=b))

    def add(name: str, fn, fargs, mismatch=None) -> None:
        if time.perf_counter() - start > args.budget_s:
            results["rows"][name] = {"skipped": "time budget"}
            return
        try:
            row = time_fn(fn, fargs, args.iters)
            if mismatch is not None:
                row["mismatched_tokens_vs_sort"] = mismatch()
        except Exception as e:  # one failing case must not lose the others
            results["rows"][name] = {"skipped": f"{type(e).__name__}: {e}"[:300]}
            print(f"  {name}: FAILED {e}", flush=True)
            return
        row["reads_of_logits"] = row["median_ms"] / (1e3 * read_s)
        results["rows"][name] = row
        print(f"  {name}: {row['median_ms']:.3f} ms", flush=True)

    for name, fn in cases.items():
        mismatch = None
        if name.startswith("threshold"):
            mismatch = lambda fn=fn: int(jnp.sum(jnp.isfinite(fn(logits, top_k, top_p))
                                                 != sort_mask))
        add(f"top-k/top-p mask: {name}", fn, (logits, top_k, top_p), mismatch)

    add("top-20 logprobs: lax.top_k", jax.jit(lambda x: jax.lax.top_k(x, MAX_LOGPROBS)),
        (logits,))
    add("top-20 logprobs: blockwise", jax.jit(
        lambda x: topk_topp.top_k_largest(x, MAX_LOGPROBS)), (logits,))

    base = key_base_data(np.ones(R, bool), np.arange(R), 0, np.zeros(R))
    md = SamplingMetadata(
        temperature=jnp.full((R,), 0.8), top_k=top_k, top_p=top_p,
        min_p=jnp.zeros((R,)), greedy=jnp.zeros((R,), bool), key_base=jnp.asarray(base),
        out_index=jnp.zeros((R,), jnp.int32), use_top_k_top_p=True)
    greedy_md = SamplingMetadata(md.temperature, md.top_k, md.top_p, md.min_p,
                                 jnp.ones((R,), bool), md.key_base, md.out_index,
                                 all_greedy=True)
    plain_md = SamplingMetadata(md.temperature, md.top_k, md.top_p, md.min_p, md.greedy,
                                md.key_base, md.out_index)
    add("sample: all greedy", jax.jit(sampler.sample), (logits, greedy_md))
    add("sample: temperature only", jax.jit(sampler.sample), (logits, plain_md))
    for impl in ("sort", "threshold"):
        # The impl is read at trace time, and jit shares traces of one function
        # across wrappers: drop them and wrap a fresh function per impl.
        sampler.TOP_K_TOP_P_IMPL = impl
        jax.clear_caches()
        add(f"sample: top-k/top-p via {impl}", jax.jit(lambda x, m: sampler.sample(x, m)),
            (logits, md))
    results["wall_s"] = time.perf_counter() - start

    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {R} x {V} f32 logits; "
          f"HBM {bw / 1e12:.2f} TB/s measured, one read of the logits = {1e3 * read_s:.3f} ms")
    print(f"{'case':<48} {'median ms':>10} {'p10':>8} {'p90':>8} {'reads':>7}")
    for name, row in results["rows"].items():
        if "skipped" in row:
            print(f"{name:<48} {'skipped':>10}  {row['skipped'][:60]}")
            continue
        print(f"{name:<48} {row['median_ms']:>10.3f} {row['p10_ms']:>8.3f} "
              f"{row['p90_ms']:>8.3f} {row['reads_of_logits']:>7.1f}"
              + (f"  mismatches={row['mismatched_tokens_vs_sort']}"
                 if "mismatched_tokens_vs_sort" in row else ""))
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "bench_sampling.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
