"""throughput: 1000 requests x (512 random prompt tokens, 128 new), all submitted at once.

--num-loras N --lora-rank R serves N random adapters on every projection, the
requests spread round-robin over them (compare with the same run without).

Reports output and total tokens/s, the roofline time (the sum over executed
steps of max(FLOPs / matmul peak, bytes / HBM bandwidth), both measured in the
same run), padding waste, and the transformers static-cache peer.

    jaxllm bench throughput --model configs/llama-3-8b --load-format dummy

--tensor-parallel-size N shards the engine over N devices: the roofline then takes one
device's bytes, all N devices' matmul peaks and the all-reduces at the bus bandwidth of
a psum measured in the same run (common.step_floor). --data-parallel-size N runs N
replica processes of this benchmark on their own devices, each with 1/N of the
requests (replicas.py says why not one engine with data_parallel_size=N).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from jaxllm.benchmarks import replicas
from jaxllm.benchmarks.common import (
    add_model_args,
    add_parallel_args,
    measure_allreduce_bandwidth,
    measure_hbm_bandwidth,
    measure_matmul_peak,
    print_table,
    step_floor,
    write_json,
)


def run_peer(args: argparse.Namespace) -> list[dict]:
    if not args.hf_peer_batch_sizes:
        return []
    cmd = [sys.executable, "-m", "jaxllm.benchmarks.hf_peer", "--model", args.model,
           "--batch-sizes", args.hf_peer_batch_sizes, "--input-len", str(args.input_len),
           "--output-len", str(args.output_len)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # keep the batch sizes measured before the failure
        print(proc.stderr[-3000:], file=sys.stderr)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    # vLLM's offline (LLM class) default on H100-class GPUs, and the fastest of
    # 8192, 16384 and 32768 for the 8B run on the H100.
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    # The workload's steps (the scheduler run with the device stubbed): 31 full 16384-
    # token steps, one of 11234 (the last prompts beside 488 decodes), one of 4302,
    # ~230 decode steps of 488-512 tokens and a tail of 8 under 256. 12288 and 256
    # take the padding waste from 2.4% to 1.5%; 6144 (the 4302-token step no longer
    # pads to 8192) to ~1.0%.
    ap.add_argument("--token-buckets", default="256,512,1024,6144,8192,12288,16384")
    ap.add_argument("--request-buckets", default="64,512")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--mlp-backend", default="auto", help="auto | xla | pallas_gpu_mosaic")
    ap.add_argument("--hbm-utilization", type=float, default=0.9)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--num-loras", type=int, default=0,
                    help="random LoRA adapters on every projection, requests spread "
                         "round-robin over them (0: LoRA off)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--hf-peer-batch-sizes", default="64,256,320,384",
                    help="transformers static-cache peer batch sizes ('' to skip)")
    add_parallel_args(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if dp < 1:
        ap.error(f"--data-parallel-size must be at least 1, got {dp}")

    peers = run_peer(args) if args.replica is None else []  # before JAX takes the GPU
    if dp > 1:
        outs = replicas.run_replicas("jaxllm.benchmarks.throughput",
                                     list(sys.argv[1:] if argv is None else argv), dp, tp)
        return report(merge_replicas(outs, dp, tp), peers, args)

    import jax

    bw = measure_hbm_bandwidth(args.probe_gib)
    peak = measure_matmul_peak(args.probe_matmul_n)
    # Under fp8 W8A8 the layers' projections run fp8 GEMMs: their peak, measured the same way.
    linear_peak = (measure_matmul_peak(args.probe_matmul_n, "float8_e4m3fn")
                   if args.quantization == "fp8" else None)
    link = measure_allreduce_bandwidth(jax.devices()[:tp], args.probe_gib / 2) if tp > 1 else None
    t0 = time.perf_counter()
    llm = make_engine(args)
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    hf = llm.llm_engine.model_config.hf_config
    prompts, params, loras = warmed_workload(llm, args, args.replica)

    replicas.barrier(args.replica)
    runner.step_log = []
    runner.wait_seconds = runner.dispatch_seconds = 0.0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - t0
    steps, runner.step_log = runner.step_log, None

    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = len(prompts) * args.input_len
    model = llm.llm_engine.engine_core.model_summary()
    nparams, wbytes = model["params"], model["weight_bytes"]
    floor = sum(step_floor(s, nparams, hf, bw, peak, tp=tp, link_bw=link, weight_nbytes=wbytes,
                           kv_itemsize=1 if args.kv_cache_dtype != "auto" else 2,
                           linear_peak=linear_peak) for s in steps)
    computed = sum(s.num_tokens for s in steps)
    padded = sum(s.padded_tokens for s in steps)
    out_tps = n_out / elapsed
    result = {
        "workload": "throughput", "num_prompts": len(prompts), "input_len": args.input_len,
        "output_len": args.output_len, "attention_backend": model["attention_backend"],
        "mlp_backend": runner.swiglu.name, "mlp_kernel": runner.swiglu.kernel,
        "num_loras": args.num_loras, "lora_rank": args.lora_rank if args.num_loras else None,
        "block_size": args.block_size, "tensor_parallel_size": tp, "data_parallel_size": 1,
        "num_devices": tp, "output_tokens": n_out, "input_tokens": n_in,
        "computed_tokens": computed, "padded_tokens": padded,
        "allreduce_bus_GBps": link / 1e9 if link else None,
        "async_scheduling": args.async_scheduling,
        "hbm_bandwidth_GBps": bw / 1e9, "matmul_TFLOPs": peak / 1e12,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "weight_bytes": wbytes,
        "fp8_matmul_TFLOPs": linear_peak / 1e12 if linear_peak else None,
        "elapsed_s": elapsed, "output_tokens_per_s": out_tps,
        "total_tokens_per_s": (n_out + n_in) / elapsed, "num_steps": len(steps),
        "roofline_s": floor, "time_over_roofline": elapsed / floor,
        "padding_waste": 1 - computed / max(padded, 1), "startup_s": startup,
        # Host time not spent waiting for the device: the rest is the device's.
        "host_busy_s": elapsed - runner.wait_seconds, "dispatch_s": runner.dispatch_seconds,
    }
    if replicas.report(args.replica, result):
        return result
    return report(result, peers, args)


def make_engine(args: argparse.Namespace) -> Any:
    """The workload's engine (one replica's) from `build_parser()`'s arguments."""
    from jaxllm import LLM

    return LLM(args.model, load_format=args.load_format, dtype=args.dtype,
               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
               num_gpu_blocks_override=args.num_gpu_blocks_override,
               skip_tokenizer_init=True,
               max_model_len=-(-(args.input_len + args.output_len + 16) // 128) * 128,
               max_num_seqs=args.max_num_seqs, block_size=args.block_size,
               max_num_batched_tokens=args.max_num_batched_tokens,
               token_buckets=[int(x) for x in args.token_buckets.split(",")],
               request_buckets=[int(x) for x in args.request_buckets.split(",")],
               enable_prefix_caching=False, attention_backend=args.attention_backend,
               mlp_backend=args.mlp_backend, hbm_utilization=args.hbm_utilization,
               async_scheduling=args.async_scheduling,
               tensor_parallel_size=args.tensor_parallel_size,
               **({"enable_lora": True, "max_loras": args.num_loras,
                   "max_lora_rank": args.lora_rank} if args.num_loras else {}))


def warmed_workload(llm: Any, args: argparse.Namespace, replica: str | None = None
                    ) -> tuple[list[dict], Any, list | None]:
    """The workload's random prompts (this replica's share), its greedy sampling params and
    its adapters, round-robin (or None), after a short warm-up that also puts every
    adapter in its slot."""
    from jaxllm import SamplingParams

    hf = llm.llm_engine.model_config.hf_config
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, hf.vocab_size, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    prompts = replicas.replica_share(prompts, replica)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    loras = None
    if args.num_loras:
        from jaxllm.benchmarks.lora_adapters import write_random_adapters

        adapters = write_random_adapters(hf, args.num_loras, args.lora_rank,
                                         tempfile.mkdtemp(prefix="bench-lora-"))
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
    warm = max(8, args.num_loras)
    llm.generate(prompts[:warm], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                 lora_request=loras[:warm] if loras else None)
    return prompts, params, loras


def merge_replicas(outs: list[dict], dp: int, tp: int) -> dict:
    """One result from `dp` replicas' results: they ran at once on their own devices,
    so the run took the slowest one's time and its roofline is the slowest one's."""
    elapsed = max(o["elapsed_s"] for o in outs)
    floor = max(o["roofline_s"] for o in outs)
    n_out = sum(o["output_tokens"] for o in outs)
    n_in = sum(o["input_tokens"] for o in outs)
    computed = sum(o["computed_tokens"] for o in outs)
    padded = sum(o["padded_tokens"] for o in outs)
    first = outs[0]
    keep = ("workload", "input_len", "output_len", "num_loras", "lora_rank",
            "attention_backend", "mlp_backend",
            "mlp_kernel", "block_size", "async_scheduling", "hbm_bandwidth_GBps",
            "matmul_TFLOPs", "allreduce_bus_GBps")
    return {
        **{k: first[k] for k in keep}, "num_prompts": sum(o["num_prompts"] for o in outs),
        "tensor_parallel_size": tp, "data_parallel_size": dp, "num_devices": dp * tp,
        "output_tokens": n_out, "input_tokens": n_in, "computed_tokens": computed,
        "padded_tokens": padded, "elapsed_s": elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + n_in) / elapsed,
        "num_steps": max(o["num_steps"] for o in outs),
        "roofline_s": floor, "time_over_roofline": elapsed / floor,
        "padding_waste": 1 - computed / max(padded, 1),
        "startup_s": max(o["startup_s"] for o in outs),
        "host_busy_s": max(o["host_busy_s"] for o in outs),
        "dispatch_s": max(o["dispatch_s"] for o in outs),
        "replicas": outs,
    }


def report(result: dict, peers: list[dict], args: argparse.Namespace) -> dict:
    """Adds the peers, writes the JSON and prints the table."""
    out_tps = result["output_tokens_per_s"]
    best_peer = max((p["output_tokens_per_s"] for p in peers if "output_tokens_per_s" in p),
                    default=None)
    result = {**result, "peers": peers,
              "speedup_vs_best_peer": out_tps / best_peer if best_peer else None}
    write_json("bench_throughput" + ("" if args.async_scheduling else "_sync"), result)
    r = result
    link = (f", all-reduce {r['allreduce_bus_GBps']:.0f} GB/s"
            if r["allreduce_bus_GBps"] else "")
    rows = [
        ("devices", f"dp {r['data_parallel_size']} x tp {r['tensor_parallel_size']}"),
        ("device HBM / bf16 matmul",
         f"{r['hbm_bandwidth_GBps'] / 1e3:.2f} TB/s / {r['matmul_TFLOPs']:.0f} TFLOP/s{link}"),
        ("attention backend", r["attention_backend"]),
        ("LoRA adapters", f"{r['num_loras']} of rank {r['lora_rank']}"
         if r.get("num_loras") else "none"),
        ("startup (load + precompile)", f"{r['startup_s']:.1f} s"),
        ("elapsed", f"{r['elapsed_s']:.1f} s over {r['num_steps']} steps"),
        ("output tok/s", f"{out_tps:.0f}"),
        ("total tok/s", f"{r['total_tokens_per_s']:.0f}"),
        ("roofline time", f"{r['roofline_s']:.1f} s -> {r['time_over_roofline']:.2f}x of it"),
        ("padding waste", f"{r['padding_waste']:.1%}"),
        ("host busy (not waiting on tokens)", f"{r['host_busy_s']:.1f} s"),
        ("  of which dispatching steps", f"{r['dispatch_s']:.1f} s"),
    ]
    for p in peers:
        rows.append((f"transformers static, batch {p['batch_size']}",
                     "out of memory" if p.get("out_of_memory") else
                     f"{p['output_tokens_per_s']:.0f} tok/s ({p['ms_per_step']:.1f} ms/step)"))
    if best_peer:
        rows.append(("speed-up over best peer", f"{out_tps / best_peer:.2f}x"))
    print_table(rows)
    return result


if __name__ == "__main__":
    main()
