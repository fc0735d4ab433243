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
    """Interface: AsyncLLM calls these from its output handler (one thread)."""

    def record_scheduler(self, stats: SchedulerStats) -> None:
        pass

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        """A request's first output token; its whole prompt counts now (vLLM's rule:
        prefix-cache hits included, a preempted request's recompute not again)."""

    def record_inter_token(self, latency: float) -> None:
        """Time since the request's previous tokens, for each output after its first."""

    def record_finished(self, stats: FinishedRequestStats) -> None:
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
        self.stats = SchedulerStats()
        self.cumulative = _Cumulative()
        self.queries = 0
        self.hits = 0
        self.draft_tokens = self.accepted_tokens = 0  # speculative decoding, this interval
        self._logged_idle = False

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self.stats = stats
        self.generation_tokens += stats.num_generation_tokens
        self.queries += self.cumulative.delta("queries", stats.prefix_cache_queries)
        self.hits += self.cumulative.delta("hits", stats.prefix_cache_hits)
        if stats.spec_decoding_stats is not None:
            self.draft_tokens += stats.spec_decoding_stats.num_draft_tokens
            self.accepted_tokens += stats.spec_decoding_stats.num_accepted_tokens

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens

    def log(self) -> str | None:
        now = time.monotonic()
        elapsed = max(now - self.last_log, 1e-9)
        s = self.stats
        idle = not (self.prompt_tokens or self.generation_tokens or s.num_running_reqs
                    or s.num_waiting_reqs)
        if idle and self._logged_idle:
            self.last_log = now
            return None  # one idle line, then quiet until there is traffic again
        self._logged_idle = idle
        hit_rate = self.hits / self.queries if self.queries else 0.0
        line = (f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
                f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
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


class PrometheusStatLogger(StatLogger):
    """Metrics under vLLM's names and semantics (`vllm:*`, labels `model_name` and `engine`),
    each also as `jaxllm:*`, in a private registry.

    Counters take vLLM's names without `_total` (the client adds it on export). Histograms:
    time to first token per request; inter-token latency once per request and engine step
    that gave it tokens (vLLM's per-iteration observation); e2e latency and the mean time per
    output token of each finished request.
    """

    def __init__(self, model_name: str, registry: prom.CollectorRegistry | None = None):
        prom.disable_created_metrics()  # the *_created series only add noise
        self.registry = registry or prom.CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, "0")  # one engine core per server
        r = self.registry
        self.cumulative = _Cumulative()

        def twin(kind: type, names: tuple[str, ...], doc: str, **kw) -> _Twin:
            return _Twin([kind(p + n, doc, labels, registry=r, **kw).labels(*values)
                          for p, n in zip(PREFIXES, names, strict=True)])

        def gauge(name: str, doc: str) -> _Twin:
            return twin(prom.Gauge, (name, name), doc)

        def counter(name: str, doc: str) -> _Twin:
            return twin(prom.Counter, (name, name), doc)

        def histogram(name: str, doc: str, buckets: list[float],
                      jaxllm_name: str | None = None) -> _Twin:
            return twin(prom.Histogram, (name, jaxllm_name or name), doc, buckets=buckets)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = full).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_hit_rate = prom.Gauge("jaxllm:prefix_cache_hit_rate",
                                          "Prefix-cache hits / queries since start.", labels,
                                          registry=r).labels(*values)
        self.preemptions = counter("num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("prompt_tokens",
                                     "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from arrival to the first output token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between a request's successive outputs of tokens.",
                             TPOT_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Mean time between output tokens of a request.", TPOT_BUCKETS,
                              jaxllm_name="time_per_output_token_seconds")
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the last output.", E2E_BUCKETS)
        success = [prom.Counter(p + "request_success", "Finished requests by reason.",
                                [*labels, "finished_reason"], registry=r) for p in PREFIXES]
        self._success = {reason: _Twin([c.labels(*values, reason) for c in success])
                         for reason in FINISH_REASONS}  # every reason exported from the start
        self._success_families = success
        self._label_values = values
        self._labels, self._twin = labels, twin
        self._spec: tuple | None = None  # made on the first speculative step
        self.total_queries = 0
        self.total_hits = 0

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        q = self.cumulative.delta("queries", stats.prefix_cache_queries)
        h = self.cumulative.delta("hits", stats.prefix_cache_hits)
        self.prefix_queries.inc(q)
        self.prefix_hits.inc(h)
        self.total_queries += q
        self.total_hits += h
        if self.total_queries:
            self.prefix_hit_rate.set(self.total_hits / self.total_queries)
        self.preemptions.inc(self.cumulative.delta("preemptions", stats.num_preemptions))
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.spec_decoding_stats is not None:
            self._record_spec(stats.spec_decoding_stats)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        """vLLM's spec_decode_* counters; acceptance per draft position is labelled
        `position`."""
        if self._spec is None:
            def counter(name: str, doc: str) -> _Twin:
                return self._twin(prom.Counter, (name, name), doc)

            per_pos = [prom.Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens at each draft position.",
                                    [*self._labels, "position"], registry=self.registry)
                       for p in PREFIXES]
            self._spec = (
                counter("spec_decode_num_drafts", "Requests whose drafts were verified."),
                counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
                counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
                [_Twin([c.labels(*self._label_values, str(i)) for c in per_pos])
                 for i in range(spec.num_spec_tokens)])
        drafts, draft_tokens, accepted, per_pos = self._spec
        drafts.inc(spec.num_drafts)
        draft_tokens.inc(spec.num_draft_tokens)
        accepted.inc(spec.num_accepted_tokens)
        for twin, n in zip(per_pos, spec.num_accepted_tokens_per_pos, strict=False):
            twin.inc(n)

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self.e2e.observe(stats.e2e_latency)
        tpot = stats.time_per_output_token
        if tpot is not None:
            self.tpot.observe(tpot)
        twin = self._success.get(stats.finish_reason)
        if twin is None:
            twin = self._success[stats.finish_reason] = _Twin(
                [c.labels(*self._label_values, stats.finish_reason)
                 for c in self._success_families])
        twin.inc()

    def record_inter_token(self, latency: float) -> None:
        self.itl.observe(latency)

    def expose(self) -> bytes:
        return prom.generate_latest(self.registry)
