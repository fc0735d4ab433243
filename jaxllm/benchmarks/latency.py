"""decode-1: batch 1, prompt 128, 256 new tokens on the Llama-3-8B shape; ms/token vs roofline.

    jaxllm bench latency --model configs/llama-3-8b --load-format dummy
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxllm.benchmarks.common import (
    add_model_args,
    kv_bytes_per_token,
    measure_hbm_bandwidth,
    param_count,
    print_table,
    write_json,
)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)

    from jaxllm import LLM, SamplingParams

    bw = measure_hbm_bandwidth()
    b, n_in, n_out = args.batch_size, args.input_len, args.output_len
    max_len = -(-(n_in + n_out + 16) // 128) * 128
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              skip_tokenizer_init=True, max_model_len=max_len, max_num_seqs=b,
              max_num_batched_tokens=n_in * b, token_buckets=[8, n_in * b],
              request_buckets=[b], enable_prefix_caching=False,
              attention_backend=args.attention_backend,
              async_scheduling=args.async_scheduling)
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.engine_core.engine_core.model_runner
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
    prefill = float(np.median([run(1) for _ in range(args.num_iters)]))
    total = float(np.median([run(n_out) for _ in range(args.num_iters)]))
    ms_per_token = (total - prefill) / (n_out - 1) * 1e3

    params = param_count(runner.state)
    avg_ctx = n_in + n_out / 2
    step_bytes = 2 * params + b * avg_ctx * kv_bytes_per_token(hf)
    floor_ms = step_bytes / bw * 1e3
    result = {
        "workload": "decode-1", "batch_size": b, "input_len": n_in, "output_len": n_out,
        "attention_backend": runner.attn_backend.name, "params": params,
        "async_scheduling": args.async_scheduling,
        "hbm_bandwidth_GBps": bw / 1e9, "ms_per_token": ms_per_token,
        "roofline_ms_per_token": floor_ms, "fraction_of_roofline": floor_ms / ms_per_token,
        "prefill_ms": prefill * 1e3, "startup_s": startup,
    }
    write_json("bench_latency" + ("" if args.async_scheduling else "_sync"), result)
    print_table([
        ("device HBM (measured)", f"{bw / 1e12:.2f} TB/s"),
        ("attention backend", runner.attn_backend.name),
        ("startup (load + precompile)", f"{startup:.1f} s"),
        ("prefill (TTFT, batch)", f"{prefill * 1e3:.1f} ms"),
        ("decode", f"{ms_per_token:.2f} ms/token"),
        ("roofline", f"{floor_ms:.2f} ms/token"),
        ("fraction of roofline", f"{floor_ms / ms_per_token:.1%}"),
    ])
    return result


if __name__ == "__main__":
    main()
