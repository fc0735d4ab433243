"""Shared pieces of the benchmarks: measured ceilings, model byte/FLOP counts, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import date
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn, *args, iters: int = 20, reps: int = 7) -> float:
    """Median seconds per call: warm up, then `reps` timed runs of `iters` queued calls.

    Queuing the calls keeps launch and sync latency out of the figure.
    """
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))


def measure_hbm_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a jitted `a * 2` over `gib` GiB of bf16 (bytes read + written)."""
    n = int(gib * (1 << 30)) // 2
    a = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    t = median_time(jax.jit(lambda x: x * 2), a, iters=10, reps=5)
    del a
    return 2 * n * 2 / t


def measure_matmul_peak(n: int = 8192) -> float:
    """FLOP/s of a jitted n^3 bf16 matmul on random data."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    t = median_time(jax.jit(lambda x, y: x @ y), a, b, iters=10, reps=5)
    return 2 * n**3 / t


def add_model_args(ap: Any) -> None:
    """--model, --load-format, --dtype: the Llama-3-8B shape with random bf16 weights."""
    ap.add_argument("--model", default="configs/llama-3-8b",
                    help="checkpoint or config directory (default: the Llama-3-8B shape)")
    ap.add_argument("--load-format", default="dummy",
                    help="dummy: random weights made on the device; auto: the checkpoint's")
    ap.add_argument("--dtype", default="bfloat16")


def param_count(state: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))


def kv_bytes_per_token(hf_config: Any, itemsize: int = 2) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * itemsize


def step_floor(rec: Any, params: int, hf_config: Any, bw: float, peak: float,
               itemsize: int = 2) -> float:
    """max(FLOPs / peak, bytes / bandwidth) of one executed step (StepRecord)."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    # Weight matmuls: 2 FLOPs per parameter per token (the embedding lookup is not a matmul,
    # but the lm_head is, and only for the sampled rows).
    embed = hf_config.vocab_size * hf_config.hidden_size
    flops = 2 * (params - 2 * embed) * rec.num_tokens + 2 * embed * rec.num_reqs
    flops += 4 * hf_config.num_hidden_layers * hf_config.num_attention_heads * head_dim \
        * rec.attn_pairs
    nbytes = itemsize * params + rec.kv_tokens * kv_bytes_per_token(hf_config, itemsize)
    return max(flops / peak, nbytes / bw)


def git_commit() -> str:
    if os.environ.get("JAXLLM_COMMIT"):  # the device's copy may carry a stale .git
        return os.environ["JAXLLM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return os.environ.get("JAXLLM_COMMIT", "unknown")


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


def write_json(name: str, result: dict[str, Any]) -> None:
    result = {"date": str(date.today()), "device": device_name(), "commit": git_commit(),
              "jax": jax.__version__, **result}
    out = os.environ.get("OUT")
    path = os.path.join(out, f"{name}.json") if out else f"{name}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
