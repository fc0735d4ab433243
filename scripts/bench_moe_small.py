"""moe-small: a decode step's routed experts, the fused Pallas kernels
(pallas_kernels/moe_small) against the per-expert loop (`routed_expert_ffn`), at the
Qwen3-30B-A3B layer shape (128 experts, top 8, H 2048, I 768, bf16) on one GPU.
`loop`, `kernel` and `kernel_only` start from the routed pairs; `route_kernel` (the jnp
routing, then the kernels) and `logits_kernel` (the routing kernel, then the kernels: the
layer's path) start from the router logits, so their difference is what the routing
kernel saves.

Each timed call runs `--layers` layers, each with its own weights and routing (as a
model's stack does), so no layer's experts are still in L2 when it runs; times are per
layer. The roofline of a layer is reading its distinct routed experts once:
`distinct x 3 x H x I x itemsize / HBM bandwidth`, the bandwidth measured in the same
run (common.measure_hbm_bandwidth). Before timing, each body's result is checked against
the loop's (bf16: within one bf16 rounding of the output's scale, as the tests bound it).
`--sweep` also times a few block-size choices of the kernel.

    PYTHONPATH=. python3 scripts/bench_moe_small.py --out $OUT/moe_small.json
    PYTHONPATH=. python3 scripts/bench_moe_small.py --small   # CPU dry run, interpret mode
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import measure_hbm_bandwidth, median_time
from jaxllm.layers.moe import (
    route,
    routed_expert_ffn,
    routed_expert_kernel,
    routed_logits_kernel,
    routed_slots,
)
from pallas_kernels.moe_small import gpu

SWEEP = [dict(block_n=32), dict(block_n=64), dict(block_h=32), dict(down_splits=2),
         dict(down_splits=4), dict(down_splits=16), dict(num_warps=4), dict(num_warps=1),
         dict(num_stages=2), dict(num_stages=4), dict(block_k=128, block_k_down=128)]


def make_layers(args: argparse.Namespace, t: int, seed: int = 0) -> dict:
    """`args.layers` layers' weights and routing for a `t`-row step, on the device."""
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(seed), 5)
    n, e, h, i = args.layers, args.experts, args.hidden, args.inter
    logits = jax.random.normal(keys[0], (n, t, e), jnp.float32)
    weights, ids = jax.vmap(lambda lg: route(lg, args.top_k, True))(logits)
    # One array per layer, as a model holds them: a slice of one stacked array would be
    # copied out (every expert of the layer) before the kernel could read it.
    return dict(
        x=jax.random.normal(keys[1], (t, h), jnp.float32).astype(dtype),
        logits=logits, weights=weights, ids=ids,
        gate_up=[(0.05 * jax.random.normal(k, (e, 2, i, h), jnp.float32)).astype(dtype)
                 for k in jax.random.split(keys[2], n)],
        down=[(0.05 * jax.random.normal(k, (e, h, i), jnp.float32)).astype(dtype)
              for k in jax.random.split(keys[3], n)])


def stacked(ffn):
    """A jitted step over every layer (each its own weights and routing; `gate_up` and
    `down` lists of per-layer arrays), the outputs summed so none is dead code."""
    def run(x, logits, weights, ids, gate_up, down):
        return sum(ffn(x, logits[n], weights[n], ids[n], gate_up[n], down[n])
                   for n in range(weights.shape[0]))
    return jax.jit(run)


def bodies(interpret: bool, top_k: int, block_sizes: gpu.BlockSizes | None = None) -> dict:
    """name -> per-layer function of (x, logits, weights, ids, gate_up, down)."""
    def kernel_only(x, lg, w, ids, gu, dn):
        slots = routed_slots(w, ids, 0, gu.shape[0])
        return gpu.moe_small(x, gu, dn, *slots, block_sizes=block_sizes, interpret=interpret)

    out = {"kernel_only": kernel_only}
    if block_sizes is None:
        out = {"loop": lambda x, lg, *a: routed_expert_ffn(x, *a),
               "kernel": lambda x, lg, *a: routed_expert_kernel(x, *a, interpret=interpret),
               "route_kernel": lambda x, lg, w, ids, gu, dn: routed_expert_kernel(
                   x, *route(lg, top_k, True), gu, dn, interpret=interpret),
               "logits_kernel": lambda x, lg, w, ids, gu, dn: routed_logits_kernel(
                   x, lg, gu, dn, top_k, True, interpret=interpret), **out}
    return out


def bench_rows(args: argparse.Namespace, t: int, bw: float) -> dict:
    data = make_layers(args, t)
    operands = (data["x"], data["logits"], data["weights"], data["ids"], data["gate_up"],
                data["down"])
    itemsize = jnp.dtype(args.dtype).itemsize
    distinct = [int(np.unique(np.asarray(data["ids"][n])).size) for n in range(args.layers)]
    roofline = sum(distinct) * 3 * args.hidden * args.inter * itemsize / bw / args.layers
    row = {"tokens": t, "distinct_experts_per_layer": float(np.mean(distinct)),
           "roofline_us": roofline * 1e6, "bodies": {}}
    timed = dict(iters=args.iters, reps=args.reps)
    fns = {name: stacked(f) for name, f in bodies(args.small, args.top_k).items()}
    want = np.asarray(fns["loop"](*operands), np.float32)
    scale = float(np.abs(want).max())
    bound = (2 ** -7 if itemsize == 2 else 1e-5) * scale * args.layers

    def measure(fn) -> dict:
        """One body's error against the loop and its time a layer."""
        err = float(np.abs(np.asarray(fn(*operands), np.float32) - want).max())
        sec = median_time(fn, *operands, **timed) / args.layers
        return {"us": sec * 1e6, "roofline_fraction": roofline / sec,
                "max_abs_err_vs_loop": err, "agrees": err <= bound}

    for name, fn in fns.items():
        row["bodies"][name] = measure(fn)
    if args.sweep:
        base = gpu.default_block_sizes(args.hidden, args.inter)
        for change in SWEEP[args.sweep_from:]:
            bs = dataclasses.replace(base, **change)
            name = "kernel_only " + ",".join(f"{k}={v}" for k, v in change.items())
            try:
                row["bodies"][name] = measure(
                    stacked(bodies(args.small, args.top_k, bs)["kernel_only"]))
            except Exception as exc:  # a tile the GPU rejects: report it, keep sweeping
                row["bodies"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time a few block-size choices")
    p.add_argument("--sweep-from", type=int, default=0,
                   help="time only the sweep's entries from this index on")
    p.add_argument("--small", action="store_true",
                   help="CPU dry run: tiny shapes, float32, the kernels in interpret mode")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if args.small:
        args.experts, args.top_k, args.hidden, args.inter = 8, 2, 32, 48
        args.dtype, args.layers, args.iters, args.reps = "float32", 2, 2, 2
        args.tokens = [t for t in args.tokens if t <= 4]
    bw = measure_hbm_bandwidth(0.01 if args.small else 2.0)
    result = {"device": str(jax.devices()[0].device_kind), "hbm_bytes_per_s": bw,
              "shape": dict(experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                            inter=args.inter, dtype=args.dtype, layers=args.layers),
              "block_sizes": dataclasses.asdict(gpu.default_block_sizes(args.hidden,
                                                                        args.inter)),
              "rows": [bench_rows(args, t, bw) for t in args.tokens]}
    print(f"{result['device']}: HBM {bw / 1e12:.2f} TB/s; us per layer "
          f"(fraction of the routed-bytes roofline)")
    for row in result["rows"]:
        print(f"T={row['tokens']:>2}  distinct experts {row['distinct_experts_per_layer']:.1f}"
              f"  roofline {row['roofline_us']:.1f} us")
        for name, b in row["bodies"].items():
            if "error" in b:
                print(f"    {name:<40} {b['error']}")
                continue
            print(f"    {name:<40} {b['us']:9.1f} us  ({b['roofline_fraction']:.0%})"
                  f"  max|diff| {b['max_abs_err_vs_loop']:.2e}"
                  f"{'' if b['agrees'] else '  DISAGREES'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
