"""What /metrics exports equals what the engine counted.

The engine core reports cumulative prefix-cache and preemption counts and
per-step token counts in `SchedulerStats`; `PrometheusStatLogger` turns them
into Prometheus counters. The HTTP view of the same registry is tested in
test_openai_server.py; here the logger is fed directly, then by a real engine
whose KV budget is too small for its batch, so that it preempts.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.config import EngineArgs
from jaxllm.core.messages import SchedulerStats
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.metrics.loggers import FinishedRequestStats, PrometheusStatLogger
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from tests.models.tiny_checkpoints import make_tiny_checkpoint


def exported(logger: PrometheusStatLogger) -> dict[str, float]:
    """{sample name (label `finished_reason` in brackets): value} of the logger's registry."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(logger.expose().decode()):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[s.name + (f"[{reason}]" if reason else "")] = s.value
    return out


def test_cumulative_core_counts_are_exported_as_their_latest_value():
    logger = PrometheusStatLogger("m")
    steps = [SchedulerStats(prefix_cache_queries=40, prefix_cache_hits=0, num_preemptions=0),
             SchedulerStats(prefix_cache_queries=40, prefix_cache_hits=0, num_preemptions=2),
             SchedulerStats(prefix_cache_queries=80, prefix_cache_hits=32, num_preemptions=2),
             SchedulerStats(prefix_cache_queries=120, prefix_cache_hits=64, num_preemptions=5)]
    for s in steps:
        logger.record_scheduler(s)
    m = exported(logger)
    assert m["jaxllm:prefix_cache_queries_total"] == 120
    assert m["jaxllm:prefix_cache_hits_total"] == 64
    assert m["jaxllm:num_preemptions_total"] == 5
    assert m["jaxllm:prefix_cache_hit_rate"] == pytest.approx(64 / 120)


def test_a_restarted_core_counting_from_zero_adds_to_the_exported_counters():
    logger = PrometheusStatLogger("m")
    logger.record_scheduler(SchedulerStats(prefix_cache_queries=50, num_preemptions=3))
    logger.record_scheduler(SchedulerStats(prefix_cache_queries=10, num_preemptions=1))
    m = exported(logger)
    assert m["jaxllm:prefix_cache_queries_total"] == 60
    assert m["jaxllm:num_preemptions_total"] == 4


def test_per_step_token_counts_and_gauges_are_exported_as_sums_and_latest_values():
    logger = PrometheusStatLogger("m")
    logger.record_scheduler(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1,
                                           kv_cache_usage=0.5, num_prompt_tokens=64))
    logger.record_first_token(0.1, 40)
    logger.record_scheduler(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.75,
                                           num_prompt_tokens=7, num_generation_tokens=2))
    logger.record_first_token(0.2, 31)
    logger.record_scheduler(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.75,
                                           num_generation_tokens=3))
    m = exported(logger)
    # Prompts count whole, once, at their first token; not the tokens a step computed.
    assert m["jaxllm:prompt_tokens_total"] == 71
    assert m["jaxllm:generation_tokens_total"] == 5
    assert (m["jaxllm:num_requests_running"], m["jaxllm:num_requests_waiting"],
            m["jaxllm:kv_cache_usage_perc"]) == (3, 0, 0.75)


def test_each_finished_request_is_counted_once_by_reason_and_in_the_histograms():
    logger = PrometheusStatLogger("m")
    for ttft in (0.01, 0.2, 3.0):
        logger.record_first_token(ttft, 10)
    logger.record_finished(FinishedRequestStats("length", 1.0, 10, 5, decode_time=0.4))
    logger.record_finished(FinishedRequestStats("stop", 2.0, 10, 1, decode_time=0.0))
    logger.record_finished(FinishedRequestStats("length", 4.0, 10, 3, decode_time=1.0))
    m = exported(logger)
    assert m["jaxllm:request_success_total[length]"] == 2
    assert m["jaxllm:request_success_total[stop]"] == 1
    assert m["jaxllm:time_to_first_token_seconds_count"] == 3
    assert m["jaxllm:time_to_first_token_seconds_sum"] == pytest.approx(3.21)
    assert m["jaxllm:e2e_request_latency_seconds_count"] == 3
    assert m["jaxllm:e2e_request_latency_seconds_sum"] == pytest.approx(7.0)
    # One generated token has no time between tokens.
    assert m["jaxllm:time_per_output_token_seconds_count"] == 2
    assert m["jaxllm:time_per_output_token_seconds_sum"] == pytest.approx(0.1 + 0.5)


@pytest.mark.slow
def test_exported_preemptions_and_prefix_counts_equal_the_engines_under_a_tiny_kv_budget(
        tmp_path):
    model = make_tiny_checkpoint(tmp_path, arch="llama")
    # 8 blocks of 8 tokens: one request of 20 + 24 tokens needs 6, so four at once preempt.
    args = EngineArgs(model=model, dtype="float32", max_model_len=128, max_num_seqs=4,
                      block_size=8, num_kv_blocks=8, max_num_batched_tokens=64,
                      token_buckets=[16, 64], request_buckets=[4], seed=0)
    prompts = [[8 + (i * 31 + 7 * k) % 240 for i in range(20)] for k in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    logger = PrometheusStatLogger("tiny")

    async def run(engine: AsyncLLM) -> list[int]:
        async def one(k: int) -> int:
            async for out in engine.generate({"prompt_token_ids": prompts[k]}, params, f"r{k}"):
                last = out
            return len(last.outputs[0].token_ids)

        return await asyncio.gather(*(one(k) for k in range(len(prompts))))

    engine = AsyncLLM.from_engine_args(args, stat_loggers=[logger])
    try:
        assert asyncio.run(run(engine)) == [24] * 4
        stats = engine.last_stats
    finally:
        engine.shutdown()
    m = exported(logger)
    assert stats.num_preemptions > 0
    assert m["jaxllm:num_preemptions_total"] == stats.num_preemptions
    assert m["jaxllm:prefix_cache_queries_total"] == stats.prefix_cache_queries
    assert m["jaxllm:prefix_cache_hits_total"] == stats.prefix_cache_hits
    # A preempted request is looked up again when readmitted, with its outputs so far.
    assert stats.prefix_cache_queries > sum(map(len, prompts))
    assert m["jaxllm:generation_tokens_total"] == 4 * 24
    # Each prompt once, although preempted requests computed theirs again.
    assert m["jaxllm:prompt_tokens_total"] == sum(map(len, prompts))
    assert m["jaxllm:request_success_total[length]"] == 4
    assert m["jaxllm:e2e_request_latency_seconds_count"] == 4
    # One inter-token interval per request and later step that gave it a token.
    assert m["jaxllm:inter_token_latency_seconds_count"] == 4 * 23
    # vLLM's names carry the same counts.
    for name in ("num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "generation_tokens_total", "prompt_tokens_total",
                 "request_success_total[length]", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count", "time_to_first_token_seconds_count"):
        assert m["vllm:" + name] == m["jaxllm:" + name], name


def test_every_update_reaches_the_vllm_names_with_model_name_and_engine_labels():
    logger = PrometheusStatLogger("m")
    logger.record_scheduler(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1,
                                           kv_cache_usage=0.25, prefix_cache_queries=30,
                                           prefix_cache_hits=16, num_preemptions=1,
                                           num_generation_tokens=3))
    logger.record_first_token(0.5, 30)
    for gap in (0.02, 0.03):
        logger.record_inter_token(gap)
    logger.record_finished(FinishedRequestStats("stop", 1.5, 30, 3, decode_time=0.05))
    m = exported(logger)
    want = {"vllm:num_requests_running": 2, "vllm:num_requests_waiting": 1,
            "vllm:kv_cache_usage_perc": 0.25, "vllm:prefix_cache_queries_total": 30,
            "vllm:prefix_cache_hits_total": 16, "vllm:num_preemptions_total": 1,
            "vllm:prompt_tokens_total": 30, "vllm:generation_tokens_total": 3,
            "vllm:request_success_total[stop]": 1, "vllm:request_success_total[length]": 0,
            "vllm:request_success_total[abort]": 0,
            "vllm:time_to_first_token_seconds_count": 1,
            "vllm:time_to_first_token_seconds_sum": 0.5,
            "vllm:inter_token_latency_seconds_count": 2,
            "vllm:inter_token_latency_seconds_sum": 0.05,
            "vllm:e2e_request_latency_seconds_count": 1,
            "vllm:e2e_request_latency_seconds_sum": 1.5,
            "vllm:request_time_per_output_token_seconds_count": 1,
            "vllm:request_time_per_output_token_seconds_sum": 0.025}
    assert {k: m[k] for k in want} == pytest.approx(want)
    for family in text_string_to_metric_families(logger.expose().decode()):
        for s in family.samples:
            assert s.labels["model_name"] == "m" and s.labels["engine"] == "0", s


def test_each_data_parallel_engine_core_has_its_own_series_and_cumulative_counts():
    from jaxllm.metrics.loggers import LoggingStatLogger

    logger = PrometheusStatLogger("m", num_engines=2)
    logger.record_scheduler(SchedulerStats(num_running_reqs=3, prefix_cache_queries=40,
                                           num_generation_tokens=3), engine=1)
    logger.record_scheduler(SchedulerStats(num_running_reqs=1, prefix_cache_queries=10,
                                           num_generation_tokens=1), engine=0)
    # Each core counts from its own zero: engine 1's 40 does not make engine 0's 10 a reset.
    logger.record_scheduler(SchedulerStats(num_running_reqs=2, prefix_cache_queries=50,
                                           num_generation_tokens=2), engine=1)
    logger.record_finished(FinishedRequestStats("stop", 1.0, 10, 5, decode_time=0.4), engine=1)
    by_engine: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(logger.expose().decode()):
        for s in family.samples:
            if s.name.startswith("vllm:") and "finished_reason" not in s.labels:
                by_engine[(s.name, s.labels["engine"])] = s.value
            elif s.name == "vllm:request_success_total":
                key = (f"{s.name}[{s.labels['finished_reason']}]", s.labels["engine"])
                by_engine[key] = s.value
    assert by_engine[("vllm:num_requests_running", "0")] == 1
    assert by_engine[("vllm:num_requests_running", "1")] == 2
    assert by_engine[("vllm:prefix_cache_queries_total", "0")] == 10
    assert by_engine[("vllm:prefix_cache_queries_total", "1")] == 50
    assert by_engine[("vllm:generation_tokens_total", "1")] == 5
    assert by_engine[("vllm:request_success_total[stop]", "1")] == 1
    assert by_engine[("vllm:request_success_total[stop]", "0")] == 0  # exported from the start

    log = LoggingStatLogger()
    log.record_scheduler(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1), engine=0)
    log.record_scheduler(SchedulerStats(num_running_reqs=3, num_waiting_reqs=0), engine=1)
    assert "Running: 5 reqs, Waiting: 1 reqs" in log.log()


def test_speculative_decoding_counts_are_exported_under_vllm_names():
    from jaxllm.core.messages import SpecDecodingStats

    logger = PrometheusStatLogger("m")
    logger.record_scheduler(SchedulerStats())
    assert not any("spec_decode" in name for name in exported(logger))  # none until used
    for drafts, tokens, accepted, per_pos in ((2, 6, 3, [2, 1, 0]), (1, 3, 3, [1, 1, 1])):
        logger.record_scheduler(SchedulerStats(spec_decoding_stats=SpecDecodingStats(
            num_spec_tokens=3, num_drafts=drafts, num_draft_tokens=tokens,
            num_accepted_tokens=accepted, num_accepted_tokens_per_pos=per_pos)))
    m = exported(logger)
    for prefix in ("vllm:", "jaxllm:"):
        assert m[prefix + "spec_decode_num_drafts_total"] == 3
        assert m[prefix + "spec_decode_num_draft_tokens_total"] == 9
        assert m[prefix + "spec_decode_num_accepted_tokens_total"] == 6
    text = logger.expose().decode()
    per_pos = {s.labels["position"]: s.value
               for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 3, "1": 2, "2": 1}


def test_the_periodic_log_line_reports_the_draft_acceptance_rate():
    from jaxllm.core.messages import SpecDecodingStats
    from jaxllm.metrics.loggers import LoggingStatLogger

    logger = LoggingStatLogger()
    logger.record_scheduler(SchedulerStats(num_running_reqs=1, num_generation_tokens=4))
    assert "Draft acceptance" not in logger.log()
    spec = SpecDecodingStats(num_spec_tokens=4, num_drafts=2, num_draft_tokens=8,
                             num_accepted_tokens=6, num_accepted_tokens_per_pos=[2, 2, 1, 1])
    logger.record_scheduler(SchedulerStats(num_running_reqs=1, spec_decoding_stats=spec))
    assert logger.log().endswith("Draft acceptance rate: 75.0%")
