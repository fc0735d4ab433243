"""Where a generate call's time goes on the device: a profiler trace, summarized.

Runs one offline generate (batch B, prompt I, O new tokens; Llama-3-8B shape,
dummy weights by default) under `jax.profiler`, then reads the Perfetto trace
and prints how busy the device was (the union of its kernel intervals over the
traced wall time), the largest idle gaps, and the kernels that took the time.

    python scripts/profile_step.py --batch-size 1 --input-len 128 --output-len 64

Under tensor parallelism (`-tp 2`) it also reads every device and host thread: how
far apart the devices start each step (at the first row-parallel sum of the peer
all-reduce), each device's busy fraction and time in those sums, and each device's
launch thread (the forward's launch and the CUDA graph launch inside it).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import tempfile
import time

import numpy as np

from jaxllm.benchmarks.common import add_model_args, print_table, write_json


def load_trace(log_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"),
                             recursive=True))
    if not paths:
        raise SystemExit(f"no Perfetto trace under {log_dir}")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def events_by_device(events: list[dict]) -> list[list[dict]]:
    """Each accelerator process's complete events ('/device:GPU:0' and the like), in
    the processes' name order."""
    pids = device_pids(events)
    by_pid: dict[int, list[dict]] = {pid: [] for pid in pids}
    for e in events:
        if e.get("ph") == "X" and e.get("dur") and e["pid"] in by_pid:
            by_pid[e["pid"]].append(e)
    return [by_pid[pid] for pid in pids]


def device_events(events: list[dict]) -> list[dict]:
    """The first accelerator process's complete events: under tensor parallelism every
    device runs the same program, and a union over devices would hide one device's idle
    time behind another's kernels."""
    return next(iter(events_by_device(events)), [])


def busy_and_gaps(events: list[dict]) -> tuple[float, list[float], float]:
    """(busy µs as a union of intervals, idle gaps in µs, span µs) over all device streams."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy, gaps, spans[-1][1] - spans[0][0] if spans else 0.0


def gap_neighbours(events: list[dict], min_us: float = 100.0, top: int = 8) -> list[dict]:
    """The idle gaps over `min_us` grouped by the kernel that ended before each and the one
    that started after it: gaps at step boundaries (the host late with the next step)
    read differently from gaps inside a step (a wait on a collective or a copy)."""
    ev = sorted(events, key=lambda e: e["ts"])
    groups: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    last, end = ev[0], ev[0]["ts"] + ev[0]["dur"]
    for e in ev[1:]:
        if e["ts"] - end > min_us:
            groups[(last["name"][:60], e["name"][:60])].append(e["ts"] - end)
        if e["ts"] + e["dur"] >= end:
            last, end = e, e["ts"] + e["dur"]
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"before": b, "after": a, "count": len(g), "total_ms": sum(g) / 1e3,
             "median_us": float(np.median(g))} for (b, a), g in rows]


def host_profile(fn, top: int = 25) -> list[dict]:
    """cProfile of `fn()`: the functions with the most cumulative time (the engine's
    step loop runs on this thread; the engine core's own process is not profiled)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]
    return [{"function": f"{os.path.basename(file)}:{line}:{name}", "calls": nc,
             "tottime_ms": tt * 1e3, "cumtime_ms": ct * 1e3}
            for (file, line, name), (_, nc, tt, ct, _) in rows]


def summarize(events: list[dict], top: int = 15, sequence: int = 0) -> dict:
    """`sequence`: also list that many kernels in launch order from the middle of the
    trace (name, start offset and duration in µs), to read one step's layer pattern."""
    dev = device_events(events)
    if not dev:
        raise SystemExit("the trace has no device events (CPU run?)")
    busy, gaps, span = busy_and_gaps(dev)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in dev:
        by_name[e["name"]].append(e["dur"])
    kernels = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)
    gaps_arr = np.array(gaps) if gaps else np.zeros(1)
    return {
        "span_ms": span / 1e3, "busy_ms": busy / 1e3, "busy_fraction": busy / span,
        "num_kernels": len(dev),
        "idle_gap_ms": {"total": float(gaps_arr.sum()) / 1e3,
                        "over_100us_count": int((gaps_arr > 100).sum()),
                        "over_100us_ms": float(gaps_arr[gaps_arr > 100].sum()) / 1e3,
                        "p50_us": float(np.median(gaps_arr)), "max_us": float(gaps_arr.max())},
        "gaps_by_neighbours": gap_neighbours(dev),
        "top_kernels": [{"name": k[:120], "total_ms": t / 1e3, "count": n, "share": t / busy}
                        for t, n, k in kernels[:top]],
        "sequence": kernel_sequence(dev, sequence),
    }


def device_pids(events: list[dict]) -> list[int]:
    """The trace's accelerator processes ('/device:GPU:0', ...) in name order."""
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return sorted((pid for pid, name in procs.items() if "/device:" in name),
                  key=lambda pid: procs[pid])


def step_skew(events: list[dict], per_step: int, marker: str = "peer_all_reduce") -> dict:
    """Under tensor parallelism: how far apart the devices start each step, read at the
    first of its `per_step` `marker` kernels (the row-parallel sums every device runs in
    the same order), and each device's busy fraction and time in those kernels (a
    device that waits for another's data spends it there)."""
    devices = []
    for ev in events_by_device(events):
        if ev:
            busy, _, span = busy_and_gaps(ev)
            marks = sorted((e for e in ev if marker in e["name"]), key=lambda e: e["ts"])
            devices.append({"busy_fraction": busy / span, "marks": marks,
                            "marker_ms": sum(e["dur"] for e in marks) / 1e3})
    steps = min((len(d["marks"]) for d in devices), default=0) // per_step
    skews, firsts = [], []
    for s in range(1, steps):  # the first step may hold the warm-up's tail
        starts = [d["marks"][s * per_step]["ts"] for d in devices]
        skews.append(max(starts) - min(starts))
        firsts += [d["marks"][s * per_step]["dur"] for d in devices]
    return {"steps": max(steps - 1, 0),
            "start_skew_us": {"median": float(np.median(skews)) if skews else None,
                              "max": max(skews) if skews else None},
            "first_marker_median_us": float(np.median(firsts)) if firsts else None,
            "devices": [{"busy_fraction": d["busy_fraction"], "marker_ms": d["marker_ms"]}
                        for d in devices]}


def _within(spans: list[dict], starts: list[float], t: float) -> bool:
    """Whether time `t` falls in one of `spans` (sorted, not overlapping; `starts` their
    start times)."""
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and t < spans[i]["ts"] + spans[i]["dur"]


def launch_threads(events: list[dict], module: str = "jit_forward:XLA GPU module") -> list[dict]:
    """Each host thread that launches the forward (one a device): its launches' median
    length, and the median of the CUDA graph launches inside them."""
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("dur") is not None:
            spans[(e["pid"], e["tid"])].append(e)
    rows = []
    for ev in spans.values():
        launches = sorted((e for e in ev if e["name"].startswith(module)),
                          key=lambda e: e["ts"])
        if not launches:
            continue
        starts = [m["ts"] for m in launches]
        graphs = [e["dur"] for e in ev if e["name"].startswith("cuGraphLaunch")
                  and _within(launches, starts, e["ts"])]
        rows.append({"launches": len(launches),
                     "median_us": float(np.median([e["dur"] for e in launches])),
                     "graph_launch_median_us": float(np.median(graphs)) if graphs else None})
    return sorted(rows, key=lambda r: -r["median_us"])


def kernel_sequence(dev: list[dict], n: int) -> list[dict]:
    ev = sorted(dev, key=lambda e: e["ts"])[len(dev) // 2:][:n]
    t0 = ev[0]["ts"] if ev else 0.0
    return [{"name": e["name"][:80], "start_us": e["ts"] - t0, "dur_us": e["dur"]} for e in ev]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile one more untraced generate (in-process engine)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by total time")
    ap.add_argument("--sequence", type=int, default=0,
                    help="also write this many kernels in launch order to the JSON")
    ap.add_argument("--name", default="profile_step", help="JSON file name under $OUT")
    args = ap.parse_args(argv)

    import jax

    from jaxllm import LLM, SamplingParams

    b, n_in = args.batch_size, args.input_len
    tokens = args.max_num_batched_tokens or n_in * b
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              skip_tokenizer_init=True, tensor_parallel_size=args.tensor_parallel_size,
              max_model_len=-(-(n_in + args.output_len + 16) // 128) * 128,
              max_num_seqs=b, max_num_batched_tokens=tokens,
              token_buckets=sorted({min(8 * -(-b // 8), tokens), tokens}),
              request_buckets=[b], enable_prefix_caching=False,
              async_scheduling=args.async_scheduling)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, n_in).tolist()} for _ in range(b)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up on the traced shapes

    log_dir = tempfile.mkdtemp(prefix="jaxllm-profile-")
    t0 = time.perf_counter()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    events = load_trace(log_dir)
    result = {"batch_size": b, "tensor_parallel_size": args.tensor_parallel_size,
              "input_len": n_in, "output_len": args.output_len,
              "async_scheduling": args.async_scheduling, "wall_ms": wall * 1e3,
              **summarize(events, args.top, args.sequence)}
    if args.tensor_parallel_size > 1:
        # The peer sums of a step: two a layer and the embedding lookup's.
        per_step = 2 * llm.llm_engine.model_config.hf_config.num_hidden_layers + 1
        result["step_skew"] = step_skew(events, per_step)
        result["launch_threads"] = launch_threads(events)
    if args.host_profile:
        t0 = time.perf_counter()
        result["host_profile"] = host_profile(
            lambda: llm.generate(prompts, params, use_tqdm=False))
        result["host_profiled_wall_ms"] = (time.perf_counter() - t0) * 1e3
    write_json(args.name, result)
    rows = [("traced wall (with profiler)", f"{wall * 1e3:.1f} ms"),
            ("device span / busy", f"{result['span_ms']:.1f} / {result['busy_ms']:.1f} ms "
                                   f"({result['busy_fraction']:.1%})"),
            ("idle gaps > 100 µs", f"{result['idle_gap_ms']['over_100us_count']} totalling "
                                   f"{result['idle_gap_ms']['over_100us_ms']:.1f} ms"),
            ("kernels launched", str(result["num_kernels"]))]
    rows += [(f"  {k['name'][:60]}", f"{k['total_ms']:.2f} ms x{k['count']} ({k['share']:.1%})")
             for k in result["top_kernels"]]
    rows += [(f"  gap {g['before'][:28]} -> {g['after'][:28]}",
              f"{g['total_ms']:.2f} ms x{g['count']} (median {g['median_us']:.0f} µs)")
             for g in result["gaps_by_neighbours"]]
    if "step_skew" in result:
        sk = result["step_skew"]
        if sk["steps"]:
            rows.append(("devices' step start skew (first sum)",
                         f"median {sk['start_skew_us']['median']:.1f} µs, max "
                         f"{sk['start_skew_us']['max']:.1f} µs over {sk['steps']} steps"))
        rows += [(f"  device {i}", f"busy {d['busy_fraction']:.1%}, in the sums "
                                   f"{d['marker_ms']:.2f} ms") for i, d in enumerate(sk["devices"])]
        rows += [("  a launch thread", f"{t['launches']} launches, median {t['median_us']:.0f} µs"
                  + (f", its graph launch {t['graph_launch_median_us']:.0f} µs"
                     if t["graph_launch_median_us"] is not None else ""))
                 for t in result["launch_threads"]]
    rows += [(f"  host {h['function'][:56]}", f"{h['cumtime_ms']:.1f} ms cum, "
                                              f"{h['tottime_ms']:.1f} own, x{h['calls']}")
             for h in result.get("host_profile", [])]
    print_table(rows)
    return result


if __name__ == "__main__":
    main()
