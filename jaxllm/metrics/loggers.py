"""Stat loggers fed by AsyncLLM's output handler.

Two sources: `SchedulerStats` (one per engine step: queue lengths, KV usage,
cumulative prefix-cache and preemption counts, tokens of the step) and
per-request timings (time to first token when it arrives, the time between its
later outputs as they come, the rest when the request finishes).
`LoggingStatLogger` prints vLLM's one-line summary every few seconds;
`PrometheusStatLogger` backs `/metrics`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import prometheus_client as prom

from jaxllm.core.messages import SchedulerStats, SpecDecodingStats

logger = logging.getLogger("jaxllm.stats")

# vLLM's bucket edges, each list with a few finer ones added in front, so that every `le`
# series a vLLM dashboard queries exists here too.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")
PREFIXES = ("vllm:", "jaxllm:")  # vLLM's names for its dashboards and autoscalers; jaxllm's own


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    decode_time: float  # first token -> last token

    @property
    def time_per_output_token(self) -> float | None:
        if self.num_generation_tokens < 2:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)


class StatLogger:
    """Interface: AsyncLLM calls these from its output handler (one thread). `engine` is
    the data-parallel engine core the stats come from (0 without data parallelism)."""

    def record_scheduler(self, stats: SchedulerStats, engine: int = 0) -> None:
        pass

    def record_first_token(self, ttft: float, num_prompt_tokens: int, engine: int = 0) -> None:
        """A request's first output token; its whole prompt counts now (vLLM's rule:
        prefix-cache hits included, a preempted request's recompute not again)."""

    def record_inter_token(self, latency: float, engine: int = 0) -> None:
        """Time since the request's previous tokens, for each output after its first."""

    def record_finished(self, stats: FinishedRequestStats, engine: int = 0) -> None:
        pass


class _Cumulative:
    """Turns the core's cumulative counts into increments."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def delta(self, name: str, value: int) -> int:
        prev = self.last.get(name, 0)
        self.last[name] = value
        return value - prev if value >= prev else value  # a restarted core counts from 0


class LoggingStatLogger(StatLogger):
    """Logs throughput, queue lengths, KV usage and prefix-cache hit rate every `interval` s."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self.last_log = time.monotonic()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.stats: dict[int, SchedulerStats] = {0: SchedulerStats()}  # by engine core
        self.cumulative: dict[int, _Cumulative] = {}
        self.queries = 0
        self.hits = 0
        self.draft_tokens = self.accepted_tokens = 0  # speculative decoding, this interval
        self._logged_idle = False

    def record_scheduler(self, stats: SchedulerStats, engine: int = 0) -> None:
        self.stats[engine] = stats
        cumulative = self.cumulative.setdefault(engine, _Cumulative())
        self.generation_tokens += stats.num_generation_tokens
        self.queries += cumulative.delta("queries", stats.prefix_cache_queries)
        self.hits += cumulative.delta("hits", stats.prefix_cache_hits)
        if stats.spec_decoding_stats is not None:
            self.draft_tokens += stats.spec_decoding_stats.num_draft_tokens
            self.accepted_tokens += stats.spec_decoding_stats.num_accepted_tokens

    def record_first_token(self, ttft: float, num_prompt_tokens: int, engine: int = 0) -> None:
        self.prompt_tokens += num_prompt_tokens

    def log(self) -> str | None:
        now = time.monotonic()
        elapsed = max(now - self.last_log, 1e-9)
        # The engine cores' latest stats, summed (KV usage: their mean).
        every = list(self.stats.values())
        running = sum(s.num_running_reqs for s in every)
        waiting = sum(s.num_waiting_reqs for s in every)
        kv_usage = sum(s.kv_cache_usage for s in every) / len(every)
        idle = not (self.prompt_tokens or self.generation_tokens or running or waiting)
        if idle and self._logged_idle:
            self.last_log = now
            return None  # one idle line, then quiet until there is traffic again
        self._logged_idle = idle
        hit_rate = self.hits / self.queries if self.queries else 0.0
        line = (f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * kv_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
        if self.draft_tokens:
            line += (f", Draft acceptance rate: "
                     f"{100 * self.accepted_tokens / self.draft_tokens:.1f}%")
        logger.info(line)
        self.last_log = now
        self.prompt_tokens = self.generation_tokens = 0
        self.queries = self.hits = 0
        self.draft_tokens = self.accepted_tokens = 0
        return line


class _Twin:
    """One labelled metric under each of PREFIXES: every update goes to all of them."""

    __slots__ = ("children",)

    def __init__(self, children: list) -> None:
        self.children = children

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def inc(self, value: float = 1.0) -> None:
        for c in self.children:
            c.inc(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class _EngineMetrics:
    """The labelled series of one engine core, and its cumulative-count state."""

    def __init__(self, families: dict[str, list], label_values: tuple[str, str]):
        self.label_values = label_values
        self.families = families
        self.cumulative = _Cumulative()
        self.total_queries = 0
        self.total_hits = 0
        self.twins = {name: _Twin([f.labels(*label_values) for f in fams])
                      for name, fams in families.items() if name != "request_success"}
        self.spec: tuple | None = None  # speculative decoding's series, from its first step
        # Every finish reason is exported from the start.
        self.success = {reason: self.success_twin(reason) for reason in FINISH_REASONS}

    def success_twin(self, reason: str) -> _Twin:
        return _Twin([f.labels(*self.label_values, reason)
                      for f in self.families["request_success"]])


class PrometheusStatLogger(StatLogger):
    """Metrics under vLLM's names and semantics (`vllm:*`, labels `model_name` and `engine`),
    each also as `jaxllm:*`, in a private registry.

    Every series is per engine core (`engine` = its data-parallel rank, "0" without data
    parallelism); the series of the `num_engines` cores exist from the start. Counters take
    vLLM's names without `_total` (the client adds it on export). Histograms: time to first
    token per request; inter-token latency once per request and engine step that gave it
    tokens (vLLM's per-iteration observation); e2e latency and the mean time per output
    token of each finished request.
    """

    def __init__(self, model_name: str, registry: prom.CollectorRegistry | None = None,
                 num_engines: int = 1):
        prom.disable_created_metrics()  # the *_created series only add noise
        self.registry = registry or prom.CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]
        r = self.registry
        fams: dict[str, list] = {}

        def twin(key: str, kind: type, names: tuple[str, ...], doc: str, **kw) -> None:
            fams[key] = [kind(p + n, doc, labels, registry=r, **kw)
                         for p, n in zip(PREFIXES, names, strict=True)]

        def gauge(name: str, doc: str) -> None:
            twin(name, prom.Gauge, (name, name), doc)

        def counter(name: str, doc: str) -> None:
            twin(name, prom.Counter, (name, name), doc)

        def histogram(name: str, doc: str, buckets: list[float],
                      jaxllm_name: str | None = None) -> None:
            twin(name, prom.Histogram, (name, jaxllm_name or name), doc, buckets=buckets)

        gauge("num_requests_running", "Requests in the running batch.")
        gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        fams["prefix_cache_hit_rate"] = [prom.Gauge(
            "jaxllm:prefix_cache_hit_rate", "Prefix-cache hits / queries since start.", labels,
            registry=r)]
        counter("num_preemptions", "Requests preempted.")
        counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        counter("generation_tokens", "Tokens generated.")
        histogram("time_to_first_token_seconds", "Time from arrival to the first output token.",
                  TTFT_BUCKETS)
        histogram("inter_token_latency_seconds",
                  "Time between a request's successive outputs of tokens.", TPOT_BUCKETS)
        histogram("request_time_per_output_token_seconds",
                  "Mean time between output tokens of a request.", TPOT_BUCKETS,
                  jaxllm_name="time_per_output_token_seconds")
        histogram("e2e_request_latency_seconds", "Time from arrival to the last output.",
                  E2E_BUCKETS)
        fams["request_success"] = [prom.Counter(p + "request_success",
                                                "Finished requests by reason.",
                                                [*labels, "finished_reason"], registry=r)
                                   for p in PREFIXES]
        self._families = fams
        self._labels = labels
        self._spec_families: dict[str, list] | None = None  # made on the first speculative step
        self._engines: dict[int, _EngineMetrics] = {}
        for e in range(num_engines):
            self._engine(e)

    def _engine(self, engine: int) -> _EngineMetrics:
        m = self._engines.get(engine)
        if m is None:
            m = self._engines[engine] = _EngineMetrics(self._families,
                                                       (self.model_name, str(engine)))
        return m

    def record_scheduler(self, stats: SchedulerStats, engine: int = 0) -> None:
        m = self._engine(engine)
        t = m.twins
        t["num_requests_running"].set(stats.num_running_reqs)
        t["num_requests_waiting"].set(stats.num_waiting_reqs)
        t["kv_cache_usage_perc"].set(stats.kv_cache_usage)
        q = m.cumulative.delta("queries", stats.prefix_cache_queries)
        h = m.cumulative.delta("hits", stats.prefix_cache_hits)
        t["prefix_cache_queries"].inc(q)
        t["prefix_cache_hits"].inc(h)
        m.total_queries += q
        m.total_hits += h
        if m.total_queries:
            t["prefix_cache_hit_rate"].set(m.total_hits / m.total_queries)
        t["num_preemptions"].inc(m.cumulative.delta("preemptions", stats.num_preemptions))
        t["generation_tokens"].inc(stats.num_generation_tokens)
        if stats.spec_decoding_stats is not None:
            self._record_spec(m, stats.spec_decoding_stats)

    def _record_spec(self, m: _EngineMetrics, spec: SpecDecodingStats) -> None:
        """vLLM's spec_decode_* counters; acceptance per draft position is labelled
        `position`."""
        if self._spec_families is None:
            fams: dict[str, list] = {}
            names = {"spec_decode_num_drafts": "Requests whose drafts were verified.",
                     "spec_decode_num_draft_tokens": "Draft tokens verified.",
                     "spec_decode_num_accepted_tokens": "Draft tokens accepted."}
            for name, doc in names.items():
                fams[name] = [prom.Counter(p + name, doc, self._labels, registry=self.registry)
                              for p in PREFIXES]
            fams["per_pos"] = [prom.Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                            "Accepted draft tokens at each draft position.",
                                            [*self._labels, "position"],
                                            registry=self.registry) for p in PREFIXES]
            self._spec_families = fams
        if m.spec is None:
            f = self._spec_families
            m.spec = tuple(_Twin([c.labels(*m.label_values) for c in f[name]])
                           for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                        "spec_decode_num_accepted_tokens")) + (
                [_Twin([c.labels(*m.label_values, str(i)) for c in f["per_pos"]])
                 for i in range(spec.num_spec_tokens)],)
        drafts, draft_tokens, accepted, per_pos = m.spec
        drafts.inc(spec.num_drafts)
        draft_tokens.inc(spec.num_draft_tokens)
        accepted.inc(spec.num_accepted_tokens)
        for twin, n in zip(per_pos, spec.num_accepted_tokens_per_pos, strict=False):
            twin.inc(n)

    def record_first_token(self, ttft: float, num_prompt_tokens: int, engine: int = 0) -> None:
        t = self._engine(engine).twins
        t["time_to_first_token_seconds"].observe(ttft)
        t["prompt_tokens"].inc(num_prompt_tokens)

    def record_finished(self, stats: FinishedRequestStats, engine: int = 0) -> None:
        m = self._engine(engine)
        m.twins["e2e_request_latency_seconds"].observe(stats.e2e_latency)
        tpot = stats.time_per_output_token
        if tpot is not None:
            m.twins["request_time_per_output_token_seconds"].observe(tpot)
        twin = m.success.get(stats.finish_reason)
        if twin is None:
            twin = m.success[stats.finish_reason] = m.success_twin(stats.finish_reason)
        twin.inc()

    def record_inter_token(self, latency: float, engine: int = 0) -> None:
        self._engine(engine).twins["inter_token_latency_seconds"].observe(latency)

    def expose(self) -> bytes:
        return prom.generate_latest(self.registry)
