"""prefix: 64 requests = one shared 1024-token prefix + a distinct 32-token suffix each.

TTFT with the prefix cached against the same work without any reuse. One
engine, prefix caching on; each iteration draws fresh random tokens:

  - uncached: every request gets its own prefix, so nothing can hit and each
    request prefills all 1056 tokens (the work of prefix caching off);
  - cached: one request with the shared prefix runs first (it fills the
    cache), then the 64 requests share that prefix and prefill their suffixes.

    jaxllm bench prefix --model configs/llama-3-8b --load-format dummy
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxllm.benchmarks.common import add_model_args, print_table, write_json


def _ttft_ms(outs) -> list[float]:
    return [(o.metrics["first_token_time"] - o.metrics["arrival_time"]) * 1e3 for o in outs]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-suffixes", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--token-buckets", default="256,1024,8192")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)

    from jaxllm import LLM, SamplingParams

    n, p_len, s_len = args.num_suffixes, args.prefix_len, args.suffix_len
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              skip_tokenizer_init=True, block_size=args.block_size,
              max_model_len=-(-(p_len + s_len + args.output_len + 16) // 128) * 128,
              max_num_seqs=n, max_num_batched_tokens=args.max_num_batched_tokens,
              token_buckets=[int(x) for x in args.token_buckets.split(",")],
              request_buckets=[n], enable_prefix_caching=True)
    startup = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def tokens(k: int) -> list[int]:
        return rng.integers(0, vocab, k).tolist()

    def run(prompts: list[list[int]]) -> tuple[float, list]:
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, outs

    def uncached() -> tuple[float, list]:
        return run([tokens(p_len + s_len) for _ in range(n)])

    def cached() -> tuple[float, list]:
        prefix = tokens(p_len)
        run([prefix + tokens(s_len)])  # fills the cache with the prefix
        return run([prefix + tokens(s_len) for _ in range(n)])

    uncached(), cached()  # warm-up: every bucket these runs touch
    rows: dict[str, dict] = {}
    for name, fn in (("uncached", uncached), ("cached", cached)):
        elapsed, ttft, hit = [], [], []
        for _ in range(args.num_iters):
            e, outs = fn()
            elapsed.append(e)
            ttft += _ttft_ms(outs)
            hit.append(sum(o.num_cached_tokens for o in outs) / (n * (p_len + s_len)))
        rows[name] = {"elapsed_ms": float(np.median(elapsed)) * 1e3,
                      "ttft_ms_mean": float(np.mean(ttft)),
                      "ttft_ms_p50": float(np.percentile(ttft, 50)),
                      "ttft_ms_p99": float(np.percentile(ttft, 99)),
                      "cached_token_fraction": float(np.mean(hit))}
    speedup = rows["uncached"]["ttft_ms_mean"] / rows["cached"]["ttft_ms_mean"]
    result = {"workload": "prefix", "prefix_len": p_len, "suffix_len": s_len,
              "num_suffixes": n, "output_len": args.output_len, "startup_s": startup,
              **rows, "ttft_speedup": speedup}
    write_json("bench_prefix", result)
    table = [("startup (load + precompile)", f"{startup:.1f} s")]
    for name, r in rows.items():
        table += [(f"{name}: batch of {n}", f"{r['elapsed_ms']:.1f} ms"),
                  (f"{name}: TTFT mean / p50 / p99",
                   f"{r['ttft_ms_mean']:.1f} / {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p99']:.1f} ms"),
                  (f"{name}: prompt tokens from cache", f"{r['cached_token_fraction']:.1%}")]
    table.append(("TTFT speed-up from the cache", f"{speedup:.2f}x"))
    print_table(table)
    return result


if __name__ == "__main__":
    main()
