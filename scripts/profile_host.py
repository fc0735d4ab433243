"""Where the host's time goes in the throughput workload: cProfile of the engine's step loop.

Runs the throughput workload (jaxllm/benchmarks/throughput.py: N requests of random
prompts, all submitted at once; optionally spread round-robin over random LoRA
adapters) once to warm up, then once under cProfile, and prints the functions
that took the most cumulative and own time, beside the runner's dispatch and
wait seconds per step. Run it with and without --num-loras to see what the
adapters add to each step's host work. `--device-trace` runs the second pass under
`jax.profiler` instead and prints where the device's time went
(scripts/profile_step.py's summary): what the adapters add to each step's kernels.

    python scripts/profile_host.py --num-loras 8 --lora-rank 16
"""

from __future__ import annotations

import cProfile
import pstats
import time

import numpy as np

from jaxllm.benchmarks.common import print_table, write_json
from jaxllm.benchmarks.throughput import build_parser, make_engine, warmed_workload


def top_functions(stats: pstats.Stats, key: str, n: int) -> list[dict]:
    """The `n` functions with the most `key` time ('cumulative' or 'tottime')."""
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{file}:{line}({name})", "calls": calls,
                     "tottime_s": own, "cumtime_s": cum})
    field = "cumtime_s" if key == "cumulative" else "tottime_s"
    return sorted(rows, key=lambda r: r[field], reverse=True)[:n]


def _time_dispatches(runner) -> list[tuple[int, float]]:
    """Wraps `runner.dispatch` to record (scheduled tokens, seconds) of each step."""
    per_step: list[tuple[int, float]] = []
    dispatch = runner.dispatch

    def timed(so, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return dispatch(so, *args, **kwargs)
        finally:
            per_step.append((so.total_num_scheduled_tokens, time.perf_counter() - t0))

    runner.dispatch = timed
    return per_step


def _forward_temp_bytes(runner) -> dict[int, int]:
    """The transient bytes of each token bucket's compiled forward (from the disk cache)."""
    programs, out = runner.programs, {}
    for tokens in runner.buckets.token_buckets:  # the cache keys by packed-input size
        program = programs.executables.get(("forward", programs.dummy_inputs(tokens).shape[0]))
        if program is not None:
            out[tokens] = int(program.compiled.memory_analysis().temp_size_in_bytes)
    return out


def _reserve(runner, hf, max_num_seqs: int) -> int:
    """What the KV cache's sizing set aside for one step's transient memory."""
    from jaxllm.worker.kv_cache import activation_reserve
    from jaxllm.worker.programs import PROMPT_LOGPROBS_ROWS

    b = runner.buckets
    return activation_reserve(hf, b.token_buckets[-1], b.request_buckets[-1], runner.vocab_size,
                              runner.dtype, PROMPT_LOGPROBS_ROWS, max_num_seqs,
                              bucket_tokens=sum(b.token_buckets))


def _by_size(per_step: list[tuple[int, float]]) -> dict[str, dict]:
    """Median and total dispatch ms of the steps of up to 1024 tokens and of larger ones."""
    out = {}
    for name, keep in (("<=1024", lambda t: t <= 1024), (">1024", lambda t: t > 1024)):
        ms = [1e3 * s for t, s in per_step if keep(t)]
        if ms:
            out[name] = {"steps": len(ms), "median_ms": float(np.median(ms)),
                         "total_ms": float(np.sum(ms))}
    return out


def device_trace(llm, prompts, params, loras, args) -> dict:
    """The workload's second pass under `jax.profiler`, summarized by kernel."""
    import tempfile

    import jax

    from scripts.profile_step import load_trace, summarize

    log_dir = tempfile.mkdtemp(prefix="jaxllm-profile-")
    t0 = time.perf_counter()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    result = {"workload": "profile_device", "num_prompts": args.num_prompts,
              "num_loras": args.num_loras, "elapsed_s": time.perf_counter() - t0,
              **summarize(load_trace(log_dir), args.top)}
    write_json("profile_device" + (f"_lora{args.num_loras}" if args.num_loras else ""), result)
    print_table([("elapsed (traced)", f"{result['elapsed_s']:.1f} s"),
                 ("device span / busy", f"{result['span_ms']:.0f} / {result['busy_ms']:.0f} ms"),
                 *((f"  {k['name'][:60]}", f"{k['total_ms']:.1f} ms x{k['count']} "
                    f"({k['share']:.1%})") for k in result["top_kernels"])])
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()  # the throughput workload's own arguments
    ap.add_argument("--top", type=int, default=30, help="functions to print")
    ap.add_argument("--device-trace", action="store_true",
                    help="trace the device's kernels instead of profiling the host")
    args = ap.parse_args(argv)
    if args.data_parallel_size != 1:
        ap.error("--data-parallel-size: the profile runs one engine in this process")

    import jax

    llm = make_engine(args)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    hf = llm.llm_engine.model_config.hf_config
    prompts, params, loras = warmed_workload(llm, args)
    if args.device_trace:
        return device_trace(llm, prompts, params, loras, args)

    runner.step_log = []
    runner.wait_seconds = runner.dispatch_seconds = 0.0
    loads = runner.lora.loads if runner.lora else 0
    per_step = _time_dispatches(runner)
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_kw: compiles.append(event) if event.endswith(
            "backend_compile_duration") or event.endswith("jaxpr_trace_duration") else None)
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    profile.disable()
    elapsed = time.perf_counter() - t0
    steps = len(runner.step_log)
    runner.step_log = None
    del runner.dispatch  # the class's own again

    stats = pstats.Stats(profile)
    cumulative = top_functions(stats, "cumulative", args.top)
    own = top_functions(stats, "tottime", args.top)
    result = {
        "workload": "profile_host", "model": args.model, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "num_loras": args.num_loras, "lora_rank": args.lora_rank if args.num_loras else None,
        "elapsed_s": elapsed, "num_steps": steps,
        "dispatch_s": runner.dispatch_seconds, "wait_s": runner.wait_seconds,
        "dispatch_ms_per_step": 1e3 * runner.dispatch_seconds / max(steps, 1),
        "adapter_loads_during_run": (runner.lora.loads - loads) if runner.lora else 0,
        # Host time in dispatch by the step's size: work that depends on the step's tokens
        # is the host waiting on the device inside the launch, not Python's.
        "dispatch_ms_by_tokens": _by_size(per_step),
        "compilations_during_run": len(compiles),  # traces and compiles: none expected
        # Two steps are in flight: their transient memory must fit beside the KV cache,
        # or a launch may wait for the step before it to free its own.
        "forward_temp_bytes": _forward_temp_bytes(runner),
        "activation_reserve_bytes": _reserve(runner, hf, args.max_num_seqs),
        "device_memory": jax.devices()[0].memory_stats(),
        "top_cumulative": cumulative, "top_own_time": own,
    }
    write_json("profile_host" + (f"_lora{args.num_loras}" if args.num_loras else ""), result)
    print(f"{'cumulative s':>12} {'own s':>8} {'calls':>8}  function (top by cumulative)")
    for r in cumulative:
        print(f"{r['cumtime_s']:12.3f} {r['tottime_s']:8.3f} {r['calls']:8d}  {r['function']}")
    print(f"\n{'own s':>12} {'cum s':>8} {'calls':>8}  function (top by own time)")
    for r in own:
        print(f"{r['tottime_s']:12.3f} {r['cumtime_s']:8.3f} {r['calls']:8d}  {r['function']}")
    sizes = result["dispatch_ms_by_tokens"]
    print_table([
        ("LoRA adapters", f"{args.num_loras} of rank {args.lora_rank}" if args.num_loras
         else "none"),
        ("elapsed (under cProfile)", f"{elapsed:.1f} s over {steps} steps"),
        ("dispatching steps", f"{runner.dispatch_seconds:.2f} s "
         f"({result['dispatch_ms_per_step']:.2f} ms/step)"),
        *((f"  steps of {k} tokens", f"{v['steps']} steps, median {v['median_ms']:.2f} ms, "
           f"total {v['total_ms'] / 1e3:.2f} s") for k, v in sizes.items()),
        ("waiting for sampled tokens", f"{runner.wait_seconds:.2f} s"),
        ("adapter loads during the run", str(result["adapter_loads_during_run"])),
        ("traces and compiles during the run", str(len(compiles))),
        ("largest forward's transient memory",
         f"{max(result['forward_temp_bytes'].values(), default=0) / 2**30:.2f} GiB "
         f"(reserved: {result['activation_reserve_bytes'] / 2**30:.2f} GiB)"),
    ])
    return result


if __name__ == "__main__":
    main()
