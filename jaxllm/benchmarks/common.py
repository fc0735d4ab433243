"""Shared pieces of the benchmarks: measured ceilings, model byte/FLOP counts, JSON output."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import time
from datetime import date
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.moe_counts import expert_counts, last_layer_mlp_params
from jaxllm.distributed.mesh import kv_head_replicas


def median_time(fn, *args, iters: int = 20, reps: int = 7, chain: bool = False) -> float:
    """Median seconds per call: warm up, then `reps` timed runs of `iters` queued calls.

    Queuing the calls keeps launch and sync latency out of the figure. `chain`: each
    call's output is the next call's one argument (a `fn` that donates it runs in place).
    """
    def call():
        nonlocal args
        out = fn(*args)
        if chain:
            args = (out,)
        return out

    for _ in range(3):
        jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        for _ in range(iters):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))


def measure_hbm_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a jitted `a * 2` over `gib` GiB of bf16 (bytes read + written), in
    place: each call's input is donated to its output, so the probe allocates and frees
    nothing while timed (under an allocator that returns memory on delete, as the
    benchmarks' worker-process mode sets, a fresh output a call timed cudaMalloc and a
    synchronizing cudaFree instead of the HBM). On an NVIDIA GPU, the larger of that and
    CUDA's own device-to-device copy (`measure_copy_bandwidth`): on the H200 XLA's
    elementwise kernels stop well short of the bandwidth the copy and the engine's
    weight reads reach, and a ceiling below what the engine reads is no ceiling."""
    n = int(gib * (1 << 30)) // 2
    a = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    # Chained in place; the values stay finite (doubled 2**53 times at most).
    t = median_time(jax.jit(lambda x: x * 2, donate_argnums=0), a, iters=10, reps=5,
                    chain=True)
    return max(2 * n * 2 / t, measure_copy_bandwidth(gib) or 0.0)


def measure_copy_bandwidth(gib: float = 2.0, iters: int = 10, reps: int = 5) -> float | None:
    """Bytes/s (read + written) of CUDA's device-to-device `cudaMemcpyAsync` of `gib` GiB
    between two buffers on the default GPU, the median of `reps` runs of `iters` queued
    copies; None off NVIDIA GPUs, without CUDA's runtime, or if a call fails."""
    from jaxllm.worker.kv_cache import cuda_runtime

    device = jax.devices()[0]
    lib = cuda_runtime() if device.platform == "gpu" else None
    if lib is None:
        return None
    a = jax.random.normal(jax.random.key(0), (int(gib * (1 << 30)) // 2,), jnp.bfloat16)
    b = jnp.zeros_like(a)
    jax.block_until_ready((a, b))
    src, dst = (ctypes.c_void_p(x.unsafe_buffer_pointer()) for x in (a, b))
    size = ctypes.c_size_t(a.nbytes)
    current = ctypes.c_int()
    lib.cudaGetDevice(ctypes.byref(current))
    lib.cudaSetDevice(device.local_hardware_id)
    times = []
    try:
        for rep in range(reps + 1):  # the first run warms up
            t0 = time.perf_counter()
            for _ in range(iters):
                if lib.cudaMemcpyAsync(dst, src, size, 3, None):  # 3: device to device
                    return None
            if lib.cudaDeviceSynchronize():
                return None
            if rep:
                times.append((time.perf_counter() - t0) / iters)
    finally:
        lib.cudaSetDevice(current.value)
    return 2 * a.nbytes / float(np.median(times))


def measure_matmul_peak(n: int = 8192, dtype: str = "bfloat16") -> float:
    """FLOP/s of a jitted n^3 matmul on random data: bf16, or with "float8_e4m3fn" the
    product the fp8 Linear runs (e4m3 operands, `x @ W.T` with W `[out, in]`, float32
    result)."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16).astype(dtype)
    if jnp.dtype(dtype) == jnp.bfloat16:
        fn = jax.jit(lambda x, y: x @ y)
    else:
        fn = jax.jit(lambda x, y: jnp.einsum("ti,oi->to", x, y,
                                             preferred_element_type=jnp.float32))
    t = median_time(fn, a, b, iters=10, reps=5)
    return 2 * n**3 / t


def _psum_operand(devices: Any, nbytes: int) -> tuple[Any, jax.Array]:
    """A mesh over `devices` (axis "x") and `nbytes` of bf16 on each of them."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = list(devices)
    n = len(devices)
    if n < 2:
        raise ValueError(f"devices: an all-reduce needs at least 2, got {n}")
    mesh = Mesh(np.asarray(devices), ("x",))
    # Made in place, each device its own row: no device holds all n buffers at once.
    x = jax.jit(lambda: jnp.ones((n, max(nbytes // 2, 1)), jnp.bfloat16),
                out_shardings=NamedSharding(mesh, P("x")))()
    return mesh, x


def measure_allreduce_seconds(devices: Any, nbytes: int) -> float:
    """Median seconds of one jitted psum of `nbytes` of bf16 on each of `devices`."""
    from jax.sharding import PartitionSpec as P

    mesh, x = _psum_operand(devices, nbytes)
    psum = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh,
                                 in_specs=P("x"), out_specs=P("x")))
    t = median_time(psum, x, iters=5, reps=5)
    del x
    return t


def measure_allreduce_chain_seconds(devices: Any, nbytes: int, chain: int = 64,
                                    peer: bool = False) -> float:
    """Seconds of one psum of `nbytes` of bf16 inside a program, as a decode step pays it:
    a jitted chain of `chain` dependent psums, less the same program without them,
    over `chain`. A lone jitted psum (`measure_allreduce_seconds`) also times the
    host's launch on every device, which a step pays once, not per all-reduce.
    `peer`: the sum by the peer all-reduce kernel (pallas_kernels/peer_allreduce), as
    the engine's small steps take it on GPUs, instead of XLA's."""
    from jax.sharding import PartitionSpec as P

    mesh, x = _psum_operand(devices, nbytes)
    table = None
    if peer:
        from pallas_kernels.peer_allreduce import gpu

        table = gpu.Workspace(mesh, "x").table

    def reduce(b: jax.Array, t: jax.Array) -> jax.Array:
        return gpu.all_reduce(b, t, "x", len(devices)) if peer else jax.lax.psum(b, "x")

    def program(links: int) -> Any:
        def body(b: jax.Array, t: jax.Array) -> jax.Array:
            for _ in range(links):  # each waits for the last: nothing to combine
                b = reduce(b, t) * jnp.bfloat16(0.5)
            return b
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()),
                                     out_specs=P("x"), check_vma=False))

    t = median_time(program(chain), x, table, iters=5, reps=5) - median_time(
        program(0), x, table, iters=5, reps=5)
    del x
    return max(t, 0.0) / chain


def measure_allreduce_bandwidth(devices: Any, gib: float = 1.0) -> float:
    """Bus bandwidth of a psum of `gib` GiB over `devices`: the bytes a ring all-reduce
    moves through each device, 2 (n - 1) / n of the buffer, per second (nccl-tests'
    busbw), the figure step_floor's all-reduce term divides by."""
    devices = list(devices)
    n = len(devices)
    nbytes = max(int(gib * (1 << 30)) // 2, 1) * 2
    return nbytes * 2 * (n - 1) / n / measure_allreduce_seconds(devices, nbytes)


def add_model_args(ap: Any) -> None:
    """--model, --load-format, --dtype, --quantization, --kv-cache-dtype,
    --num-gpu-blocks-override: the Llama-3-8B shape with random bf16 weights."""
    ap.add_argument("--model", default="configs/llama-3-8b",
                    help="checkpoint or config directory (default: the Llama-3-8B shape)")
    ap.add_argument("--load-format", default="dummy",
                    help="dummy: random weights made on the device; auto: the checkpoint's")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                    help="weight quantization (jaxllm/layers/quant.py)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto: the model dtype")
    ap.add_argument("--num-gpu-blocks-override", type=int, default=None,
                    help="a fixed KV cache of this many blocks, as vLLM's (runs compared "
                         "at one cache size, whatever memory each device has free)")


def add_parallel_args(ap: Any) -> None:
    """--tensor-parallel-size, --data-parallel-size, and the probes' sizes."""
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="devices each engine shards the model over")
    ap.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="independent engine replicas (one process each on its own "
                         "tp devices, each taking 1/dp of the requests; see "
                         "benchmarks/replicas.py for why not the engine's own "
                         "--data-parallel-size)")
    ap.add_argument("--probe-gib", type=float, default=2.0,
                    help="GiB of the HBM bandwidth probe (the all-reduce probe takes half)")
    ap.add_argument("--probe-matmul-n", type=int, default=8192,
                    help="side of the matmul peak probe")
    # Set by the data-parallel parent on its replicas (benchmarks/replicas.py).
    ap.add_argument("--replica", default=None, help=argparse.SUPPRESS)


def kv_bytes_per_token(hf_config: Any, itemsize: int = 2) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * itemsize


def kv_bytes_per_device_token(hf_config: Any, tp: int = 1, itemsize: int = 2) -> float:
    """One token's K and V on one of `tp` shards: the kv heads split over the shards, or,
    with fewer kv heads than shards, each shard holds one replicated kv head."""
    return kv_bytes_per_token(hf_config, itemsize) * kv_head_replicas(hf_config, tp) / tp


def allreduce_bytes_per_device(rec: Any, hf_config: Any, tp: int, itemsize: int = 2) -> float:
    """Bytes each of `tp` devices sends in one step's all-reduces: two per layer (after
    the attention output projection and after the MLP's down projection) of
    [tokens, hidden]; the last layer's only at the sampled rows (as its FLOPs). A ring
    all-reduce moves 2 (tp - 1) / tp of the buffer through each device."""
    if tp == 1:
        return 0.0
    rows = (hf_config.num_hidden_layers - 1) * rec.num_tokens + rec.num_reqs
    return 2 * rows * hf_config.hidden_size * itemsize * 2 * (tp - 1) / tp


def step_floor(rec: Any, params: int, hf_config: Any, bw: float, peak: float,
               itemsize: int = 2, tp: int = 1, link_bw: float | None = None,
               weight_nbytes: float | None = None, linear_peak: float | None = None,
               kv_itemsize: int | None = None) -> float:
    """The least time of one executed step (StepRecord) on `tp` tensor-parallel devices:
    max(FLOPs / (tp * peak), per-device bytes / bw) plus the all-reduces at `link_bw`.

    `bw` and `peak` are one device's HBM bandwidth and matmul peak; `link_bw` is the
    all-reduce bus bandwidth (bytes each device moves per second, as
    measure_allreduce_bandwidth reports it), needed when tp > 1. Each device reads its
    1/tp of the weights and its share of the KV cache. A mixture of experts counts the
    experts the step's tokens are routed to (benchmarks/moe_counts.py); its experts
    split over the devices, each reads 1/tp of those.

    Quantized weights: `weight_nbytes` is what the weights take as held (`weight_bytes`;
    default `itemsize * params`; experts, kept in the model dtype, not read this step
    are taken off at `itemsize`), and `linear_peak` the peak of the projections (the
    fp8 matmul peak under fp8 W8A8; default `peak`), while attention and the LM head
    (kept in the model dtype) run at `peak`. `kv_itemsize`: the KV cache's bytes per
    element (default `itemsize`; 1 for an fp8 cache).
    """
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    # Weight matmuls: 2 FLOPs per parameter per token (the embedding lookup is not a matmul,
    # but the lm_head is, and only for the sampled rows). Tied embeddings (Gemma) count
    # the one [vocab, hidden] matrix once in `params`.
    embed = hf_config.vocab_size * hf_config.hidden_size
    # Mixture of experts: a token multiplies by its top_k experts only, and the step
    # reads the experts its tokens picked (benchmarks/moe_counts.py).
    flop_params, read_params = params, float(params)
    counts = expert_counts(hf_config)
    if counts is not None:
        flop_params = params - counts.all_expert_params + counts.routed_params
        read_params = (params - counts.all_expert_params
                       + counts.read_params(rec.num_tokens, rec.num_reqs))
    tables = 1 if getattr(hf_config, "tie_word_embeddings", False) else 2
    flops = 2 * (flop_params - tables * embed) * rec.num_tokens + 2 * embed * rec.num_reqs
    # The last layer needs every token's K/V but its q, attention output, output
    # projection and MLP only at each request's last token (the model's forward_rows).
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    rows_only = 2 * heads * head_dim * hidden + last_layer_mlp_params(hf_config)
    flops -= 2 * rows_only * max(rec.num_tokens - rec.num_reqs, 0)
    # Sliding-window layers (Gemma, Mistral) are counted as full attention: exact while
    # every context fits the window, an over-count beyond it.
    attn = 4 * heads * head_dim * (
        (hf_config.num_hidden_layers - 1) * rec.attn_pairs + rec.kv_tokens)
    flops += attn
    if weight_nbytes is None:
        weights = itemsize * read_params
    else:
        weights = weight_nbytes - itemsize * (params - read_params)
    if linear_peak is None:
        compute = flops / peak
    else:  # the projections at linear_peak; the LM head and attention at peak
        head = 2 * embed * rec.num_reqs
        compute = (flops - head - attn) / linear_peak + (head + attn) / peak
    if tp == 1:
        nbytes = weights + rec.kv_tokens * kv_bytes_per_token(hf_config, kv_itemsize)
        return max(compute, nbytes / bw)
    if link_bw is None or link_bw <= 0:
        raise ValueError(f"link_bw: tp={tp} needs the measured all-reduce bandwidth, "
                         f"got {link_bw}")
    nbytes = (weights / tp
              + rec.kv_tokens * kv_bytes_per_device_token(hf_config, tp, kv_itemsize))
    comm = allreduce_bytes_per_device(rec, hf_config, tp, itemsize) / link_bw
    return max(compute / tp, nbytes / bw) + comm


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


# NVML's clock event reasons that mean the chip ran slower than it should: a hot or
# failing machine, not the power cap every H100 reaches under load (0x4).
_SLOWDOWN_REASONS = {0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                     0x40: "hardware thermal slowdown", 0x80: "hardware power brake"}
_GPU_FIELDS = ("clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw",
               "clocks_event_reasons.active")


def parse_gpu_state(csv_line: str) -> dict[str, Any]:
    """One GPU's line of `nvidia-smi --query-gpu=<_GPU_FIELDS> --format=csv,noheader,nounits`."""
    sm, sm_max, temp, power, reasons = (v.strip() for v in csv_line.split(","))
    mask = int(reasons, 16)
    return {"sm_clock_MHz": int(sm), "sm_clock_max_MHz": int(sm_max),
            "temperature_C": int(temp), "power_W": float(power), "clock_event_reasons": mask,
            "slowdowns": [why for bit, why in _SLOWDOWN_REASONS.items() if mask & bit]}


def gpu_state() -> dict[str, Any] | None:
    """Clocks, temperature and slowdown reasons of the first NVIDIA GPU now; None without
    one (or without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(_GPU_FIELDS)}",
                              "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return parse_gpu_state(out.strip().splitlines()[0])
    except Exception:  # no nvidia-smi, or one too old for these fields
        return None


def write_json(name: str, result: dict[str, Any]) -> None:
    """Writes `result` with the run's context; the GPU's state is taken now, hot from the run,
    and a warning printed when it was slowing itself down (figures then read low)."""
    state = gpu_state()
    if state and state["slowdowns"]:
        print(f"WARNING: the GPU reports {', '.join(state['slowdowns'])} at the end of this run "
              f"({state['temperature_C']} C, SM clock {state['sm_clock_MHz']} of "
              f"{state['sm_clock_max_MHz']} MHz): its figures are not the hardware's")
    result = {"date": str(date.today()), "device": device_name(), "commit": git_commit(),
              "jax": jax.__version__, "gpu_state": state, **result}
    out = os.environ.get("OUT")
    path = os.path.join(out, f"{name}.json") if out else f"{name}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
