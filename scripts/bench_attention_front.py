"""attention-front: a decode step's input norm, QKV projection, q/k norms, rotary and
K/V write, as the engine runs them today (XLA's norm and QKV GEMV, then the
`qkv_rope` kernel) against the one fused kernel (pallas_kernels/qkv_rope/fused_gpu.py),
under the engine's GPU XLA flags.

Each timed call runs `--layers` layers, each with its own weights and cache pages (so
no layer's weights are still in L2), chained through the residual stream as a model's
layers are; times are per layer, both bodies paying the same chaining add. The floor
of a layer is reading its QKV weight once at the HBM bandwidth measured in the same
run. Before timing, the fused body's q and cache are checked against the unfused
body's (bf16: within one rounding). `--sweep` also times a few block sizes.

    PYTHONPATH=. python3 scripts/bench_attention_front.py --out $OUT/attention_front.json
    PYTHONPATH=. python3 scripts/bench_attention_front.py --shape llama-3-8b
    PYTHONPATH=. python3 scripts/bench_attention_front.py --small   # CPU dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import measure_hbm_bandwidth, median_time
from jaxllm.layers.norm import rms_norm
from pallas_kernels.qkv_rope import fused_gpu, gpu

# (hidden, kv heads, group, head_dim, q/k norms, layers)
SHAPES = {"qwen3-30b-a3b": (2048, 4, 8, 128, True, 48),
          "llama-3-8b": (4096, 8, 4, 128, False, 32)}
SWEEP = [dict(block_k=64), dict(block_k=256), dict(num_warps=8), dict(num_warps=2),
         dict(num_stages=2), dict(num_stages=4), dict(block_k=64, num_stages=6)]
PAGE, PAGES_PER_LAYER, EPS = 16, 8, 1e-6


def make_layers(hidden, kv, group, d, layers, t, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    w = (jax.random.normal(ks[0], (layers, kv, group + 2, d, hidden), jnp.float32)
         * hidden ** -0.5).astype(dtype)
    in_norms = (1.0 + 0.1 * jax.random.normal(ks[1], (layers, hidden))).astype(dtype)
    qk_norms = (1.0 + 0.1 * jax.random.normal(ks[2], (layers, 2, d))).astype(dtype)
    x = jax.random.normal(ks[3], (t, hidden), jnp.float32).astype(dtype)
    cache = jnp.zeros((layers * PAGES_PER_LAYER, 2 * kv, PAGE, d), dtype)
    positions = jnp.arange(100, 100 + t, dtype=jnp.int32)
    slots = jnp.arange(PAGE, PAGE + t, dtype=jnp.int32)  # page 1 on: page 0 is scratch
    inv_freq = jnp.asarray(1.0 / (1e6 ** (np.arange(0, d, 2, dtype=np.float32) / d)))
    return dict(w=w, in_norms=in_norms, qk_norms=qk_norms, x=x, cache=cache,
                positions=positions, slots=slots, inv_freq=inv_freq)


def unfused_layer(x, w, in_norm, qk_norms, cache, c, layer, qk_norm, interpret):
    xn = rms_norm(x, in_norm, EPS)
    qkv = jnp.einsum("th,kgdh->tkgd", xn, w)
    return gpu.project_qkv(qkv, c["positions"], c["inv_freq"], cache, c["slots"],
                           layer * PAGES_PER_LAYER, qk_norms if qk_norm else None, layer,
                           eps=EPS, offset=False, interpret=interpret)


def fused_layer(x, w, in_norm, qk_norms, cache, c, layer, qk_norm, interpret, bs):
    return fused_gpu.norm_project_qkv(x, in_norm, w, c["positions"], c["inv_freq"], cache,
                                      c["slots"], layer * PAGES_PER_LAYER,
                                      qk_norms if qk_norm else None, layer, eps=EPS,
                                      offset=False, block_sizes=bs, interpret=interpret)


def stack(body, layers, hidden):
    """`layers` layers of `body`, the residual stream carried from each to the next."""
    def run(c, cache):
        x = c["x"]
        for i in range(layers):
            q, cache = body(x, c["w"][i], c["in_norms"][i], c["qk_norms"], cache, c, i)
            x = x + (1e-3 * q.reshape(x.shape[0], -1)[:, :hidden]).astype(x.dtype)
        return x, cache
    return jax.jit(run, donate_argnums=1)


def _max_diff(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,16", help="step rows, comma separated")
    ap.add_argument("--layers", type=int, default=0, help="0: the model's")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--small", action="store_true", help="tiny shapes, interpret mode")
    ap.add_argument("--out", default="bench_attention_front.json")
    args = ap.parse_args()

    hidden, kv, group, d, qk_norm, layers = SHAPES[args.shape]
    interpret = args.small
    if args.small:
        hidden, kv, group, d, layers = 256, 2, 2, 64, 2
    layers = args.layers or layers
    dtype = jnp.bfloat16
    hbm = None if interpret else measure_hbm_bandwidth()
    w_bytes = kv * (group + 2) * d * hidden * 2
    res = dict(shape=args.shape, layers=layers, hbm_GBps=hbm and hbm / 1e9, rows={})
    variants = [("unfused", None), ("fused", fused_gpu.BlockSizes())]
    if args.sweep:
        variants += [(f"fused {kw}", dataclasses.replace(fused_gpu.BlockSizes(), **kw))
                     for kw in SWEEP if hidden % kw.get("block_k", 16) == 0]
    for t in (int(s) for s in args.tokens.split(",")):
        c = make_layers(hidden, kv, group, d, layers, t, dtype)
        cache0 = c.pop("cache")  # passed apart, donated, not inside `c`
        bodies = {}
        for name, bs in variants:
            if bs is None:
                f = functools.partial(unfused_layer, qk_norm=qk_norm, interpret=interpret)
            else:
                f = functools.partial(fused_layer, qk_norm=qk_norm, interpret=interpret, bs=bs)
            bodies[name] = stack(f, layers, hidden)
        want_x, want_cache = bodies["unfused"](c, jnp.copy(cache0))
        got_x, got_cache = bodies["fused"](c, jnp.copy(cache0))
        err, xerr = _max_diff(got_cache, want_cache), _max_diff(got_x, want_x)
        row = dict(cache_max_abs_diff=err, x_max_abs_diff=xerr, us_per_layer={})
        print(f"T={t}: fused vs unfused max |diff| cache {err:.3g}, stream {xerr:.3g}")
        if not interpret:
            for name, body in bodies.items():
                cache = jnp.copy(cache0)
                try:  # a sweep point may not compile (shared memory)
                    s = median_time(lambda cache, body=body, c=c: body(c, cache)[1], cache,
                                    iters=10, reps=5, chain=True)
                except Exception as e:  # noqa: BLE001 - report it and go on
                    row["us_per_layer"][name] = f"failed: {str(e)[:200]}"
                    print(f"T={t} {name:40s} failed: {str(e)[:200]}", flush=True)
                    continue
                us = s / layers * 1e6
                row["us_per_layer"][name] = round(us, 2)
                print(f"T={t} {name:40s} {us:7.2f} us a layer", flush=True)
            row["floor_us"] = round(w_bytes / hbm * 1e6, 2)
            print(f"T={t} floor (the QKV weight at {hbm / 1e9:.0f} GB/s): {row['floor_us']} us")
        res["rows"][t] = row
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
