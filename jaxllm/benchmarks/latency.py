"""decode-1: batch 1, prompt 128, 256 new tokens on the Llama-3-8B shape; ms/token vs roofline.

    jaxllm bench latency --model configs/llama-3-8b --load-format dummy

With --tensor-parallel-size the roofline is one device's bytes (its 1/tp of the weights
and its share of the cache) over its HBM bandwidth plus the step's all-reduces at the bus
bandwidth a psum over the tp devices measures in the same run. --data-parallel-size N
runs N replicas (benchmarks/replicas.py), each decoding batch-size / N requests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from jaxllm.benchmarks import replicas, workers
from jaxllm.benchmarks.common import (
    add_model_args,
    add_parallel_args,
    measure_allreduce_bandwidth,
    measure_allreduce_chain_seconds,
    measure_hbm_bandwidth,
    print_table,
    step_floor,
    write_json,
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--worker-processes", action="store_true",
                    help="tensor parallelism as one process per device on this host, as "
                         "vLLM's workers (benchmarks/workers.py), not one process driving all")
    add_parallel_args(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if dp < 1 or args.batch_size % dp:
        ap.error(f"--data-parallel-size {dp} must be at least 1 and divide --batch-size "
                 f"{args.batch_size}: each replica decodes batch-size / dp requests")
    if args.worker_processes and (tp < 2 or dp > 1):
        ap.error("--worker-processes needs --tensor-parallel-size of 2 or more and no "
                 "--data-parallel-size")
    if dp > 1:
        outs = replicas.run_replicas("jaxllm.benchmarks.latency",
                                     list(sys.argv[1:] if argv is None else argv), dp, tp,
                                     ["--batch-size", str(args.batch_size // dp)])
        slowest = max(outs, key=lambda o: o["ms_per_token"])
        result = {**slowest, "batch_size": args.batch_size, "data_parallel_size": dp,
                  "num_devices": dp * tp,
                  "prefill_ms": max(o["prefill_ms"] for o in outs),
                  "startup_s": max(o["startup_s"] for o in outs), "replicas": outs}
        return report(result, args)

    if args.worker_processes:
        workers.release_probe_memory()  # before JAX starts: the probes give memory back
    import jax

    from jaxllm import LLM

    bw = measure_hbm_bandwidth(args.probe_gib)
    link = measure_allreduce_bandwidth(jax.devices()[:tp], args.probe_gib / 2) if tp > 1 else None
    b, n_in, n_out = args.batch_size, args.input_len, args.output_len
    max_len = -(-(n_in + n_out + 16) // 128) * 128
    with (workers.worker_processes(tp, os.environ.get("OUT") or tempfile.mkdtemp())
          if args.worker_processes else contextlib.nullcontext({})) as job:
        t0 = time.perf_counter()
        llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                  num_gpu_blocks_override=args.num_gpu_blocks_override,
                  skip_tokenizer_init=True, max_model_len=max_len, max_num_seqs=b,
                  max_num_batched_tokens=n_in * b, token_buckets=[8, n_in * b],
                  request_buckets=[b], enable_prefix_caching=False,
                  attention_backend=args.attention_backend,
                  async_scheduling=args.async_scheduling, tensor_parallel_size=tp, **job)
        startup = time.perf_counter() - t0
        try:
            result = _decode(llm, args, startup, bw, link)
        finally:
            llm.llm_engine.shutdown()
    if replicas.report(args.replica, result):
        return result
    return report(result, args)


def _decode(llm: Any, args: argparse.Namespace, startup: float, bw: float,
            link: float | None) -> dict:
    """Times prefill and decode on the started engine; the run's figures and floors."""
    import jax

    from jaxllm import SamplingParams
    from jaxllm.worker.model_runner import StepRecord

    tp, b = args.tensor_parallel_size, args.batch_size
    n_in, n_out = args.input_len, args.output_len
    model = llm.llm_engine.engine_core.model_summary()
    hf = llm.llm_engine.model_config.hf_config
    vocab = hf.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, n_in).tolist()} for _ in range(b)]

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run(4)  # warm-up
    replicas.barrier(args.replica)
    prefill = float(np.median([run(1) for _ in range(args.num_iters)]))
    total = float(np.median([run(n_out) for _ in range(args.num_iters)]))
    ms_per_token = (total - prefill) / (n_out - 1) * 1e3

    params = model["params"]
    # The average decode step: b tokens, each reading half the new tokens past its prompt.
    # Decode at small batch is bandwidth-bound: the FLOPs (peak not measured) play no part.
    avg_ctx = n_in + n_out / 2
    step = StepRecord(num_tokens=b, padded_tokens=b, num_reqs=b, kv_tokens=b * avg_ctx,
                      attn_pairs=b * avg_ctx)
    wbytes = model["weight_bytes"]
    floor_ms = step_floor(step, params, hf, bw, float("inf"), tp=tp, link_bw=link,
                          weight_nbytes=wbytes,
                          kv_itemsize=1 if args.kv_cache_dtype != "auto" else 2) * 1e3
    # A decode step's all-reduces are a few KiB, where a collective's fixed latency, not
    # the bus bandwidth, sets its time: a second floor takes each at the measured time
    # of one in-program sum of [batch, hidden] bf16 as the engine sums (the peer kernel
    # where its small steps take it), to tell that cost apart from the engine's.
    small_s = (measure_allreduce_chain_seconds(jax.devices()[:tp], b * hf.hidden_size * 2,
                                               peer=model.get("row_reduce") == "peer")
               if tp > 1 else 0.0)
    memory_ms = step_floor(step, params, hf, bw, float("inf"), tp=tp,
                           link_bw=float("inf"), weight_nbytes=wbytes,
                           kv_itemsize=1 if args.kv_cache_dtype != "auto" else 2) * 1e3
    collective_floor_ms = memory_ms + 2 * hf.num_hidden_layers * small_s * 1e3
    result = {
        "workload": "decode-1", "batch_size": b, "input_len": n_in, "output_len": n_out,
        "attention_backend": model["attention_backend"], "params": params,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "weight_bytes": wbytes,
        "async_scheduling": args.async_scheduling, "tensor_parallel_size": tp,
        "data_parallel_size": 1, "num_devices": tp,
        "hbm_bandwidth_GBps": bw / 1e9, "allreduce_bus_GBps": link / 1e9 if link else None,
        "ms_per_token": ms_per_token,
        "roofline_ms_per_token": floor_ms, "fraction_of_roofline": floor_ms / ms_per_token,
        "allreduce_step_us": small_s * 1e6, "row_reduce": model.get("row_reduce"),
        "floor_with_allreduce_latency_ms": collective_floor_ms,
        "prefill_ms": prefill * 1e3, "startup_s": startup,
        "worker_processes": args.worker_processes, "engine_processes": model["num_processes"],
    }
    return result


def report(result: dict, args: argparse.Namespace) -> dict:
    """Writes the JSON and prints the table."""
    r = result
    write_json("bench_latency" + ("" if args.async_scheduling else "_sync"), r)
    link = (f", all-reduce {r['allreduce_bus_GBps']:.0f} GB/s"
            if r["allreduce_bus_GBps"] else "")
    print_table([
        ("devices", f"dp {r['data_parallel_size']} x tp {r['tensor_parallel_size']}"),
        ("device HBM (measured)", f"{r['hbm_bandwidth_GBps'] / 1e3:.2f} TB/s{link}"),
        ("attention backend", r["attention_backend"]),
        ("startup (load + precompile)", f"{r['startup_s']:.1f} s"),
        ("prefill (TTFT, batch)", f"{r['prefill_ms']:.1f} ms"),
        ("decode", f"{r['ms_per_token']:.2f} ms/token"),
        ("roofline", f"{r['roofline_ms_per_token']:.2f} ms/token"),
        ("fraction of roofline", f"{r['fraction_of_roofline']:.1%}"),
    ] + ([("one decode all-reduce (measured)",
           f"{r['allreduce_step_us']:.1f} us ({r['row_reduce'] or 'XLA'}'s)"),
          ("floor with all-reduces at that time",
           f"{r['floor_with_allreduce_latency_ms']:.2f} ms/token")]
         if r["tensor_parallel_size"] > 1 else []))
    return result


if __name__ == "__main__":
    main()
