"""Where a tensor-parallel decode step's time goes, without the engine: a synthetic
Llama-shaped step (the projections of every layer, two psums a layer, batch rows of
`[rows, hidden]`), timed at tp 1 and at tp N with and without its psums, under
several XLA / NCCL settings, each in a process of its own (XLA reads its flags once).

    python scripts/bench_tp_decode.py --tp 2            # the sweep of settings
    python scripts/bench_tp_decode.py --tp 2 --setting base   # one setting
    python scripts/bench_tp_decode.py --tp 2 --rows 8192 --chunks 2 --settings base
                                        # also on two row chunks: does a psum overlap?

The step with psums less the step without them is what the collectives cost in a
step; the step without them against tp 1's is what sharding the weights saves.
Weights are constants (their values do not change the time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

COLLECTIVE_POOL = {"XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB": "1024"}
# name -> (extra XLA flags, extra environment); a flag this jaxlib lacks fails that
# setting's process alone.
SETTINGS: dict[str, tuple[str, dict[str, str]]] = {
    "base": ("", {}),
    "one_shot_on": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true", {}),
    "one_shot_off": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false", {}),
    "sync_allreduce": ("--xla_gpu_disable_async_collectives=ALLREDUCE", {}),
    "no_cmd_buffer": ("--xla_gpu_enable_command_buffer=", {}),
    "cmd_buffer_collectives": (
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES",
        {}),
    "one_shot_sync": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true "
                      "--xla_gpu_disable_async_collectives=ALLREDUCE", {}),
    "lhs": ("--xla_gpu_enable_latency_hiding_scheduler=true", {}),
    "nccl_ll128": ("", {"NCCL_PROTO": "LL128"}),
    "nccl_simple": ("", {"NCCL_PROTO": "Simple"}),
    # collective buffers from a pool of NCCL's memory, registered with the communicator,
    # and then as symmetric windows (NCCL's symmetric all-reduce kernels); jaxlib 0.11.2
    # accepts the flags but registers nothing (BENCHMARKS.md, Several GPUs)
    "user_buffers": ("--xla_gpu_enable_nccl_user_buffers=true", COLLECTIVE_POOL),
    "symmetric": ("--xla_gpu_enable_nccl_user_buffers=true "
                  "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true", COLLECTIVE_POOL),
    # NCCL's captured launches without the joins that let them mix with uncaptured ones
    "no_graph_mixing": ("", {"NCCL_GRAPH_MIXING_SUPPORT": "0"}),
}

SHAPE_8B = {"hidden": 4096, "q": 4096, "kv": 1024, "inter": 14336, "layers": 32}
SHAPE_SMALL = {"hidden": 256, "q": 256, "kv": 64, "inter": 512, "layers": 4}  # CPU checks


def step_program(shape: dict, mesh, rows: int, with_psum: bool, chunks: int = 1):
    """The jitted step: per layer x += psum(o(qkv(x))) and x += psum(down(gate_up(x))).

    `chunks` > 1 runs every row-wise part (projections, psums, residual adds) on that
    many row chunks, joined only where attention stands in (a mean over every row),
    so one chunk's psum can overlap another chunk's matmuls."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    tp = mesh.shape["model"]
    h, inter = shape["hidden"], shape["inter"]
    qkv = (shape["q"] + 2 * shape["kv"]) // tp

    def reduce(y):
        return jax.lax.psum(y, "model") if with_psum else y

    def body(x, w):
        xs = jnp.split(x, chunks)
        for wqkv, wo, wgu, wd in w:
            a = jnp.concatenate([xc @ wqkv for xc in xs])
            # stands in for attention: every row's output depends on every row
            a = a[:, : shape["q"] // tp] * jax.nn.sigmoid(jnp.mean(a[:, -1:]))
            xs = [xc + reduce(ac @ wo) for xc, ac in zip(xs, jnp.split(a, chunks), strict=True)]
            out = []
            for xc in xs:
                g = xc @ wgu
                m = jax.nn.silu(g[:, : inter // tp]) * g[:, inter // tp:]
                out.append(xc + reduce(m @ wd))
            xs = out
        return jnp.concatenate(xs)

    col, row = P(None, "model"), P("model", None)
    layer_specs = (col, row, col, row)
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(P(), [layer_specs] * shape["layers"]), out_specs=P(),
                       check_vma=False)
    shapes = [((h, qkv * tp), (shape["q"], h), (h, 2 * inter), (inter, h))] * shape["layers"]

    def make():
        ws = []
        for i, layer in enumerate(shapes):
            ws.append(tuple(jnp.full(s, 1e-3 * (i + 1), jnp.bfloat16) for s in layer))
        return ws

    from jax.sharding import NamedSharding
    shard = [tuple(NamedSharding(mesh, s) for s in layer_specs)] * shape["layers"]
    weights = jax.jit(make, out_shardings=shard)()
    x = jnp.ones((rows, h), jnp.bfloat16)
    return jax.jit(fn), x, weights


def run_one(args) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxllm.benchmarks.common import median_time

    shape = SHAPE_SMALL if args.small else SHAPE_8B
    out = {"setting": args.setting, "rows": args.rows}
    devices = jax.devices()
    for tp in sorted({1, args.tp}):
        mesh = Mesh(np.asarray(devices[:tp]), ("model",))
        # at tp N also on row chunks when asked; at tp 1 a psum is the identity
        for chunks in sorted({1, args.chunks} if tp == args.tp else {1}):
            for with_psum in ([False] if tp == 1 else [True, False]):
                fn, x, w = step_program(shape, mesh, args.rows, with_psum, chunks)
                t = median_time(fn, x, w, iters=20, reps=7)
                name = (f"tp{tp}" + ("_chunks" if chunks > 1 else "")
                        + ("" if with_psum or tp == 1 else "_no_psum"))
                out[name + "_ms"] = t * 1e3
                del w
    tp = args.tp
    if tp > 1:
        out["psum_cost_ms"] = out[f"tp{tp}_ms"] - out[f"tp{tp}_no_psum_ms"]
        out["per_psum_us"] = out["psum_cost_ms"] * 1e3 / (2 * shape["layers"])
        out["tp_speedup"] = out["tp1_ms"] / out[f"tp{tp}_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="batch rows of the decode step")
    ap.add_argument("--small", action="store_true", help="a tiny shape, for CPU checks")
    ap.add_argument("--chunks", type=int, default=1,
                    help="also time the step on this many row chunks (psum overlap)")
    ap.add_argument("--setting", default=None, help=f"one of {list(SETTINGS)}; default all")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="the sweep's settings")
    args = ap.parse_args()
    if args.setting is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    results = []
    for name in args.settings.split(","):
        flags, env = SETTINGS[name]
        e = dict(os.environ, **env)
        e["XLA_FLAGS"] = (e.get("XLA_FLAGS", "") + " " + flags).strip()
        cmd = [sys.executable, __file__, "--tp", str(args.tp), "--rows", str(args.rows),
               "--setting", name, "--chunks", str(args.chunks)] + ["--small"] * args.small
        p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            err = (p.stderr.strip().splitlines() or ["?"])[-1][:160]
            results.append({"setting": name, "error": err})
        else:
            results.append(json.loads(line[0][7:]))
        print(json.dumps(results[-1]), flush=True)
    from jaxllm.benchmarks.common import write_json
    write_json(f"tp_decode_tp{args.tp}_rows{args.rows}", {"tp": args.tp, "results": results})
    for r in results:
        if "error" in r:
            print(f"{r['setting']:<24} error: {r['error']}")
        else:
            print(f"{r['setting']:<24} tp1 {r['tp1_ms']:.3f} ms  tp{args.tp} "
                  f"{r[f'tp{args.tp}_ms']:.3f} ms  no-psum {r[f'tp{args.tp}_no_psum_ms']:.3f} ms"
                  f"  per psum {r['per_psum_us']:.1f} us  speed-up {r['tp_speedup']:.2f}x"
                  + (f"  chunks {r[f'tp{args.tp}_chunks_ms']:.3f} ms"
                     f" (no psum {r[f'tp{args.tp}_chunks_no_psum_ms']:.3f})"
                     if args.chunks > 1 else ""))


if __name__ == "__main__":
    main()
