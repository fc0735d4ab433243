"""spec-verify: a verify step of k + 1 tokens per request against a decode step.

    python scripts/bench_spec.py --model configs/llama-3-8b --load-format dummy

Part 1 times, for batch sizes 1 and 64 and k = 1..7, one verify step (the
forward over k + 1 tokens per request at a context of --context-len tokens,
then the rejection sampler) against one decode step (one token per request,
then the sampler), both greedy, on the runner's own jitted programs fed
synthetic step inputs. With per-position acceptance rate a, a verify step
emits (1 - a^(k+1)) / (1 - a) tokens on average, so the implied speed-up is
that times t_decode / t_verify (draft proposal time not counted: ngram drafts
cost host time only). Part 2 runs the embedded demo model on a copy-heavy
workload (its tasks' prompts, greedy, --demo-output-len tokens, ignore_eos)
with and without ngram speculation and reports the measured acceptance and
the wall-clock speed-up. JSON to $OUT/bench_spec.json; a table last.
`--dry-run` shrinks everything for a CPU check.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from jaxllm.benchmarks.common import add_model_args, median_time, print_table, write_json


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7")
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV blocks (default: sized from the device's memory)")
    ap.add_argument("--acceptance", default="0.5,0.7,0.9")
    ap.add_argument("--demo-k", type=int, default=4)
    ap.add_argument("--demo-num-prompts", type=int, default=32)
    ap.add_argument("--demo-output-len", type=int, default=128)
    ap.add_argument("--demo-batched-tokens", type=int, default=1024)
    ap.add_argument("--demo-token-buckets", type=lambda v: [int(x) for x in v.split(",")],
                    default=None, help="comma-separated (default: the engine's)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes for a CPU check (k 1..2, batch 1 and 2, short demo)")
    return ap


def synthetic_step(b: int, q: int, ctx: int, buckets, block_size: int, vocab: int,
                   rng: np.random.Generator) -> np.ndarray:
    """Packed forward inputs: `b` requests, each computing `q` new tokens after `ctx`
    cached ones, in blocks of their own."""
    from jaxllm.worker.step_inputs import pack_step_inputs

    t = b * q
    (packed, input_ids, positions, slots, _, page_indices, kv_lens, cu_end, num_seqs,
     _) = pack_step_inputs(buckets.pad_tokens(t), buckets.max_num_seqs,
                           buckets.max_blocks_per_req)
    nb = -(-(ctx + q) // block_size)
    blocks = 1 + np.arange(b * nb, dtype=np.int32).reshape(b, nb)
    page_indices[:b, :nb] = blocks
    pos = ctx + np.tile(np.arange(q, dtype=np.int32), b)
    positions[:t] = pos
    req = np.repeat(np.arange(b), q)
    slots[:t] = blocks[req, pos // block_size] * block_size + pos % block_size
    input_ids[:t] = rng.integers(0, vocab, t)
    kv_lens[:b] = ctx + q
    cu_end[:b] = np.arange(1, b + 1) * q
    cu_end[b:] = t
    num_seqs[:] = b
    return packed


def verify_times(args: argparse.Namespace, b: int, ks: list[int]) -> dict:
    """Median seconds of a decode step and of a verify step for each k, at batch `b`."""
    from jaxllm import LLM
    from jaxllm.sample.metadata import variant_metadata
    from jaxllm.spec_decode.config import SpeculativeConfig
    from jaxllm.worker.spec_verify import SpecVerifier

    k_max, bs, ctx = max(ks), args.block_size, args.context_len
    max_len = -(-(ctx + k_max + 1 + 16) // 128) * 128
    blocks = args.num_kv_blocks or None
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              skip_tokenizer_init=True, max_model_len=max_len, max_num_seqs=b,
              max_num_batched_tokens=b * (k_max + 1),
              token_buckets=sorted({b * (k + 1) for k in [0, *ks]}), request_buckets=[b],
              block_size=bs, enable_prefix_caching=False, precompile=False,
              num_kv_blocks=blocks)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    vocab, put = runner.vocab_size, runner.input_batch.sampling.device_put
    rng = np.random.default_rng(0)
    holder = [runner.kv_cache]
    md = next(variant_metadata(b, vocab, put, np.zeros(b, np.int32)))  # greedy
    packed = synthetic_step(b, 1, ctx, runner.buckets, bs, vocab, rng)

    def decode():
        holder[0], _, last_hidden, out_index = runner.programs.run_forward(
            runner.state, holder[0], packed, runner._no_prev)
        return runner.programs.sample(last_hidden, md).token_ids

    out = {"decode_ms": median_time(decode) * 1e3, "verify_ms": {}}
    for k in ks:
        spec = SpecVerifier(SpeculativeConfig(num_speculative_tokens=k), *runner.graph,
                            runner.buckets)
        packed_k = synthetic_step(b, k + 1, ctx, runner.buckets, bs, vocab, rng)
        rows = spec.verify_rows(np.arange(b) * (k + 1), np.full(b, k + 1),
                                np.full(b, k, np.int32))
        ids = rng.integers(0, vocab, (b, k)).astype(np.int32)
        counts = np.full(b, k, np.int32)

        def verify(spec=spec, packed_k=packed_k, rows=rows, ids=ids, counts=counts):
            holder[0], hidden = spec.forward(runner.state, holder[0], packed_k, rows,
                                             spec.no_drafts)
            return spec.sample(runner.programs.head, hidden, ids, counts, md).tokens

        out["verify_ms"][k] = median_time(verify) * 1e3
    runner.kv_cache = holder[0]
    return out


DEMO_KV_BYTES = 256 << 20


def demo_workload(args: argparse.Namespace) -> dict:
    """The demo model, greedy on its tasks' prompts, with and without ngram drafts."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.demo_tasks import TASKS, make_prompt

    rng = random.Random(0)
    prompts = [make_prompt(TASKS[i % len(TASKS)], rng) for i in range(args.demo_num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.demo_output_len, ignore_eos=True)
    out = {}
    for name, spec in (("no_spec", None), ("ngram", {
            "method": "ngram", "num_speculative_tokens": args.demo_k,
            "prompt_lookup_max": 3, "prompt_lookup_min": 1})):
        # A fixed cache: the 8B model of the verify timings may still hold the device's
        # memory, which the default sizing would count as taken.
        llm = LLM(max_num_seqs=max(8, args.demo_num_prompts), speculative_config=spec,
                  kv_cache_bytes=DEMO_KV_BYTES, max_num_batched_tokens=args.demo_batched_tokens,
                  token_buckets=args.demo_token_buckets)
        core = llm.llm_engine.engine_core.engine_core
        stats, make_stats = [], core.scheduler.make_stats

        def recording(make_stats=make_stats, stats=stats):
            s = make_stats()
            if s.spec_decoding_stats is not None:
                stats.append(s.spec_decoding_stats)
            return s

        core.scheduler.make_stats = recording
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: the same run, untimed
        stats.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        drafted = sum(s.num_draft_tokens for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats)
        out[name] = {"seconds": seconds, "output_tokens": tokens,
                     "tokens_per_s": tokens / seconds,
                     "draft_tokens": drafted, "accepted_tokens": accepted,
                     "acceptance_rate": accepted / drafted if drafted else None,
                     "outputs": [o.outputs[0].token_ids for o in outs]}
    out["greedy_outputs_equal"] = out["ngram"].pop("outputs") == out["no_spec"].pop("outputs")
    out["speed_up"] = out["ngram"]["tokens_per_s"] / out["no_spec"]["tokens_per_s"]
    return out


def implied_speed_up(decode_ms: float, verify_ms: float, k: int, a: float) -> float:
    """Tokens a verify step emits on average at acceptance `a`, per decode-step time."""
    return (1 - a ** (k + 1)) / (1 - a) * decode_ms / verify_ms


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        args.batch_sizes, args.ks, args.context_len = "1,2", "1,2", 32
        args.demo_num_prompts, args.demo_output_len = 2, 8
        args.demo_batched_tokens, args.demo_token_buckets = 64, [16, 64]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    rates = [float(x) for x in args.acceptance.split(",")]
    steps = {b: verify_times(args, b, ks) for b in sizes}
    result = {"workload": "spec-verify", "model": args.model, "context_len": args.context_len,
              "sampling": "greedy", "steps": {}, "demo": demo_workload(args)}
    for b, t in steps.items():
        result["steps"][b] = {"decode_ms": t["decode_ms"], "verify": {
            k: {"ms": ms, "ratio_to_decode": ms / t["decode_ms"],
                "implied_speed_up": {a: implied_speed_up(t["decode_ms"], ms, k, a)
                                     for a in rates}}
            for k, ms in t["verify_ms"].items()}}
    write_json("bench_spec", result)
    rows = []
    for b, r in result["steps"].items():
        rows.append((f"batch {b}: decode step", f"{r['decode_ms']:.2f} ms"))
        for k, v in r["verify"].items():
            ups = " / ".join(f"{u:.2f}x" for u in v["implied_speed_up"].values())
            rows.append((f"batch {b}: verify k={k}",
                         f"{v['ms']:.2f} ms ({v['ratio_to_decode']:.2f}x decode), "
                         f"speed-up at a={'/'.join(map(str, rates))}: {ups}"))
    d = result["demo"]
    rate = d["ngram"]["acceptance_rate"]
    rows += [("demo ngram acceptance", "none drafted" if rate is None else f"{rate:.1%}"),
             ("demo speed-up (wall clock)", f"{d['speed_up']:.2f}x"),
             ("demo greedy outputs equal", str(d["greedy_outputs_equal"]))]
    print_table(rows)
    return result


if __name__ == "__main__":
    main()
