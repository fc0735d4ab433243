"""serving: Poisson arrivals at several request rates against the OpenAI server.

Every request streams /v1/completions with a random token-id prompt of
`--input-len` tokens and `--output-len` new tokens (ignore_eos), so it runs
against a model without a tokenizer too. Per rate: TTFT, TPOT, inter-token
latency and end-to-end latency (mean, p50, p99), request and token throughput.

Target a running server:
    jaxllm bench serving --base-url http://127.0.0.1:8000 --vocab-size 128256
or let the script start one (and stop it afterwards):
    jaxllm bench serving --model configs/llama-3-8b --load-format dummy \\
        --server-args "--max-num-seqs 256 --max-num-batched-tokens 8192"

This process never imports JAX: the server owns the accelerator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import date

import httpx
import numpy as np

from jaxllm.benchmarks.common import git_commit, gpu_state


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""


@dataclass
class RateResult:
    request_rate: float
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99))}


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, model: str | None,
                      prompt: list[int], output_len: int) -> RequestResult:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    res = RequestResult(ok=False, prompt_len=len(prompt))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage") and not chunk.get("choices"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                    continue
                n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if n == 0:
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.output_len += n
        res.e2e = time.perf_counter() - start
        res.ok = res.ttft > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Inter-arrival times: Poisson (burstiness 1) or gamma; rate inf sends all at once."""
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


async def run_rate(args: argparse.Namespace, base_url: str, rate: float,
                   prompts: list[list[int]]) -> RateResult:
    rng = np.random.default_rng(args.seed + 1)
    gaps = arrival_gaps(len(prompts), rate, args.burstiness, rng)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    limiter = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    url = base_url + "/v1/completions"

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout),
                                 limits=limits) as client:
        async def limited(prompt: list[int]) -> RequestResult:
            if limiter is None:
                return await one_request(client, url, headers, args.served_model_name,
                                         prompt, args.output_len)
            async with limiter:
                return await one_request(client, url, headers, args.served_model_name,
                                         prompt, args.output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"  {len(failed)} failed, e.g. {failed[0].error}", file=sys.stderr)
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    return RateResult(
        request_rate=rate, num_requests=len(prompts), completed=len(done), failed=len(failed),
        duration_s=duration, request_throughput=len(done) / duration,
        output_token_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        ttft_ms=_stats_ms([r.ttft for r in done]), tpot_ms=_stats_ms(tpots),
        itl_ms=_stats_ms([g for r in done for g in r.itl]), e2e_ms=_stats_ms([r.e2e for r in done]))


def make_prompts(n: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Skip the lowest ids, where the special tokens usually are; distinct prompts, so the
    # prefix cache finds nothing to share.
    low = min(1000, vocab_size // 4)
    return rng.integers(low, vocab_size, size=(n, input_len)).tolist()


def vocab_size_of(model: str | None) -> int | None:
    if not model:
        return None
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(json.load(f)["vocab_size"])


# ----------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str, float]:
    """Starts `jaxllm serve`; returns it, its URL, its log and seconds until /health said 200."""
    t0 = time.monotonic()
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve"]
    if args.model:
        cmd.append(args.model)
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    if args.load_format == "dummy" or args.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    cmd += shlex.split(args.server_args)
    log = tempfile.NamedTemporaryFile(prefix="bench-serving-", suffix=".log", delete=False)
    print("starting:", shlex.join(cmd), f"(log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.server_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log.name, errors="replace") as f:
                sys.exit(f"server exited with {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    sys.exit(f"server not healthy after {args.server_timeout}s (log: {log.name})")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape_metrics(url: str) -> dict[str, float]:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        if base in ("jaxllm:num_preemptions_total", "jaxllm:prefix_cache_hit_rate",
                    "jaxllm:generation_tokens_total", "jaxllm:prompt_tokens_total"):
            out[base] = float(value)
    return out


# ----------------------------------------------------------------------------- main


def _json_safe(x):
    """NaN -> null and inf -> "inf": strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def print_rate(r: RateResult) -> None:
    rate = "inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}"
    print(f"rate {rate:>5} req/s | done {r.completed}/{r.num_requests} in {r.duration_s:.1f}s | "
          f"{r.request_throughput:.2f} req/s, {r.output_token_throughput:.0f} out tok/s, "
          f"{r.total_token_throughput:.0f} total tok/s")
    for name, s in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms),
                    ("E2E", r.e2e_ms)):
        print(f"    {name:<4} ms  mean {s['mean']:9.1f}  p50 {s['p50']:9.1f}  p99 {s['p99']:9.1f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server (else one is started)")
    ap.add_argument("--model", default=None, help="checkpoint dir for the started server; "
                    "also where --vocab-size is read from")
    ap.add_argument("--load-format", default=None, help="e.g. dummy (random weights)")
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--server-args", default="", help="extra `jaxllm serve` flags, one string")
    ap.add_argument("--server-timeout", type=float, default=1800.0)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"))
    ap.add_argument("--request-rates", default="1,4,16,inf",
                    help="comma-separated requests/s; inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the arrival gaps; 1 = Poisson")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--measure-warm-start", action="store_true",
                    help="afterwards, start the server again and time it to healthy")
    ap.add_argument("--result-json", default=None,
                    help="output path (default: $OUT/bench_serving.json or ./bench_serving.json)")
    args = ap.parse_args(argv)

    rates = [float(r) for r in args.request_rates.split(",")]
    vocab = args.vocab_size or vocab_size_of(args.model) or 1000
    proc = None
    url = args.base_url.rstrip("/") if args.base_url else None
    startup = warm_startup = None
    if url is None:
        proc, url, _, startup = start_server(args)
        print(f"server healthy after {startup:.1f}s", flush=True)
    try:
        warm = make_prompts(args.warmup_requests, args.input_len, vocab, args.seed + 99)
        if warm:
            asyncio.run(run_rate(args, url, math.inf, warm))
        results = []
        for i, rate in enumerate(rates):
            prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed + i)
            before = scrape_metrics(url)
            r = asyncio.run(run_rate(args, url, rate, prompts))
            after = scrape_metrics(url)
            print_rate(r)
            row = asdict(r)
            row["preemptions"] = after.get("jaxllm:num_preemptions_total", 0.0) - before.get(
                "jaxllm:num_preemptions_total", 0.0)
            results.append(row)
    finally:
        if proc is not None:
            stop_server(proc)
    if proc is not None and args.measure_warm_start:
        # Same flags again: the compilation cache written by the first start is warm now.
        proc, _, _, warm_startup = start_server(args)
        stop_server(proc)
        print(f"warm restart: server healthy after {warm_startup:.1f}s", flush=True)

    out = {"benchmark": "serving", "date": str(date.today()), "commit": git_commit(),
           "base_url": url,
           "model": args.model, "load_format": args.load_format, "input_len": args.input_len,
           "output_len": args.output_len, "num_prompts": args.num_prompts,
           "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
           "server_args": args.server_args, "server_startup_s": startup,
           "server_warm_startup_s": warm_startup, "gpu_state": gpu_state(), "results": results}
    path = args.result_json or os.path.join(os.environ.get("OUT", "."), "bench_serving.json")
    with open(path, "w") as f:
        json.dump(_json_safe(out), f, indent=1)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
