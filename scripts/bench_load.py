"""Weight load time and peak host memory: safetensors against a `jaxllm convert` orbax checkpoint.

    python scripts/bench_load.py --model configs/llama-3-8b --dtype bfloat16 \\
        [--tensor-parallel-size 1] [--workdir /tmp/x]

Writes a safetensors checkpoint of the config's shape (random values, in shards
of one layer each, like a Hugging Face export) to a temporary directory, converts
it with `jaxllm convert`, then loads each in a fresh process through the engine's
loader (`load_model`, every array placed and ready). Per path it prints the load
seconds, peak host RSS over the process (getrusage) and the peak RSS a sampling
thread saw above the pre-load baseline; JSON goes to $OUT/bench_load.json (or the
current directory). Both checkpoints are freshly written, so both are read from
the page cache where it holds them: the numbers compare the loaders, not disks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

_RANDOM_CHUNK = 1 << 24  # elements of random data tiled over every tensor


def _hf_shape(name: str, arch) -> tuple[int, ...]:
    """The Hugging Face shape of one Llama-family tensor."""
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * d, (arch.num_kv_heads // arch.kv_replicas) * d
    leaf = name.rsplit(".", 2)[-2]
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return (arch.vocab_size, h)
    if leaf in ("q_norm", "k_norm"):
        return (d,)
    if leaf.endswith("layernorm") or name == "model.norm.weight":
        return (h,)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": inter,
            "up_proj": inter, "down_proj": h}[leaf]
    cols = {"o_proj": q, "down_proj": inter}.get(leaf, h)
    return (rows,) if name.endswith(".bias") else (rows, cols)


def write_safetensors(config_dir: str, out_dir: str, dtype: str) -> int:
    """A safetensors checkpoint of the config's shape in `out_dir`; returns its bytes."""
    import ml_dtypes
    from transformers import AutoConfig

    from jaxllm.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(config_dir)
    model_cls = get_model_class(cfg.architectures[0])
    arch = model_cls.arch_from_hf_config(cfg)
    np_dtype = np.dtype({"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
                         "float32": np.float32}[dtype])
    st_name = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[dtype]
    names = [n for src in model_cls.hf_weight_map(cfg)
             for n in src.tensors]
    shards: dict[str, list[str]] = {}
    for n in names:
        key = n.split(".")[2] if n.startswith("model.layers.") else "other"
        shards.setdefault(key, []).append(n)
    rng = np.random.default_rng(0)
    chunk = (rng.standard_normal(_RANDOM_CHUNK, dtype=np.float32) * 0.02).astype(np_dtype)
    os.makedirs(out_dir, exist_ok=True)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards.values()):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for n in tensors:
            shape = _hf_shape(n, arch)
            size = int(np.prod(shape)) * np_dtype.itemsize
            header[n] = {"dtype": st_name, "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[n] = fname
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for n in tensors:  # one tensor on the host at a time
                count = int(np.prod(_hf_shape(n, arch)))
                f.write(np.resize(chunk, count).tobytes())
        total += offset
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(config_dir, "config.json")) as f:
        raw = json.load(f)
    raw["torch_dtype"] = raw["dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return total


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_load(model_dir: str, load_format: str, tp: int, dtype: str) -> dict:
    """Loads the weights once in this process; what the parent records for one path."""
    import jax

    from jaxllm.config import EngineArgs
    from jaxllm.distributed.mesh import make_mesh
    from jaxllm.layers.attention import get_attention_backend
    from jaxllm.models.loader import load_model

    mc = EngineArgs(model=model_dir, load_format=load_format, tensor_parallel_size=tp,
                    dtype=dtype, skip_tokenizer_init=True).create_engine_config().model_config
    mesh = make_mesh(tp, hf_config=mc.hf_config)
    attn = get_attention_backend("xla")
    jax.block_until_ready(jax.device_put(np.zeros(1)))  # backend up before the clock
    baseline, peak, stop = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = load_model(mc, mesh, attn)
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    return {"load_format": load_format, "load_s": seconds,
            "weight_bytes": int(sum(x.nbytes for x in leaves)),
            "baseline_rss_bytes": baseline, "peak_rss_above_baseline_bytes": peak[0] - baseline,
            "peak_rss_bytes_getrusage": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device": str(jax.devices()[0].device_kind)}


def _run_child(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="configs/llama-3-8b",
                    help="directory with the config.json whose shape is benchmarked")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a "
                                                    "temporary directory, removed at the end)")
    ap.add_argument("--child", nargs=2, metavar=("DIR", "FORMAT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tp = args.tensor_parallel_size
    if args.child:
        print(json.dumps(child_load(args.child[0], args.child[1], tp, args.dtype)))
        return

    work = args.workdir or tempfile.mkdtemp(prefix="bench_load_")
    st_dir, ob_dir = os.path.join(work, "safetensors"), os.path.join(work, "orbax")
    try:
        t0 = time.perf_counter()
        size = write_safetensors(args.model, st_dir, args.dtype)
        print(f"wrote {size / 2**30:.2f} GiB of safetensors in {time.perf_counter() - t0:.1f}s",
              flush=True)
        common = ["--tensor-parallel-size", str(tp), "--dtype", args.dtype]
        results = [_run_child(["--child", st_dir, "safetensors", *common])]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", "convert", st_dir, ob_dir,
                        *common], check=True)
        convert_s = time.perf_counter() - t0
        results.append(_run_child(["--child", ob_dir, "orbax", *common]))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    gib = 2**30
    print(f"{'path':<12} {'load s':>8} {'peak RSS GiB':>13} {'peak above base GiB':>20}")
    for r in results:
        print(f"{r['load_format']:<12} {r['load_s']:>8.2f} "
              f"{r['peak_rss_bytes_getrusage'] / gib:>13.2f} "
              f"{r['peak_rss_above_baseline_bytes'] / gib:>20.2f}")
    print(f"convert (subprocess, incl. start-up): {convert_s:.1f}s; weights "
          f"{results[0]['weight_bytes'] / gib:.2f} GiB on {results[0]['device']}")
    out_dir = os.environ.get("OUT") or "."
    report = {"model": args.model, "dtype": args.dtype, "tensor_parallel_size": tp,
              "checkpoint_bytes": size, "convert_s": convert_s, "results": results}
    with open(os.path.join(out_dir, "bench_load.json"), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
