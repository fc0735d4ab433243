"""Scheduler: budgets, chunked prefill, priorities, preemption, stop conditions, and
hypothesis-driven random workloads against a fake model runner."""

import random
import zlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from jaxllm.core.messages import FinishReason, LogprobsLists
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.core.scheduler import Scheduler
from jaxllm.sampling_params import PoolingParams, SamplingParams
from tests.core.scheduler_workloads import scheduler_shapes

# ------------------------------------------------------------------ helpers


def make_scheduler(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8,
                   max_num_batched_tokens=32, chunked=True, policy="fcfs", threshold=0,
                   caching=True, windows=(None,)) -> Scheduler:
    model = ModelConfig(model="fake", tokenizer="fake", dtype="float32",
                        max_model_len=max_model_len, seed=0, skip_tokenizer_init=True,
                        load_format="dummy", served_model_name="fake", hf_config=None)
    return Scheduler(EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=caching,
                                 num_blocks=num_blocks, group_windows=windows),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=chunked, policy=policy,
            long_prefill_token_threshold=threshold),
        parallel_config=ParallelConfig()))


def make_request(rid, prompt, eos=None, arrival=0.0, priority=0, pooling=False, **params):
    if isinstance(prompt, int):
        prompt = [100 + i for i in range(prompt)]
    if pooling:
        return Request(rid, list(prompt), None, PoolingParams(), arrival_time=arrival)
    params.setdefault("max_tokens", 100)
    return Request(rid, list(prompt), SamplingParams(**params), eos_token_id=eos,
                   arrival_time=arrival, priority=priority)


def sample_all(sched, out, token=7, logprobs=None, prompt_logprobs=None, pooled=None):
    """A runner that samples `token` for every request whose prompt is complete."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens and not req.is_pooling
        sampled.append([token(rid) if callable(token) else token] if done else [])
    return ModelRunnerOutput(req_ids, sampled,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs or {},
                             pooler_output=pooled or {})


def step(sched, token=7):
    out = sched.schedule()
    return out, sched.update_from_output(out, sample_all(sched, out, token))


def by_id(engine_outputs):
    return {o.request_id: o for o in engine_outputs.all_outputs()}


# ------------------------------------------------------------------ budgets and chunking


def test_long_prompt_is_split_into_chunks_within_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 20))
    chunks, computed = [], []
    for _ in range(3):
        out, eco = step(sched)
        chunks.append(out.num_scheduled_tokens["a"])
        new = out.scheduled_new_reqs
        computed.append(new[0].num_computed_tokens if new
                        else out.scheduled_cached_reqs.num_computed_tokens[0])
        if chunks[-1] == 8:
            assert eco.all_outputs() == []  # a partial prompt samples nothing
    assert chunks == [8, 8, 4] and computed == [0, 8, 16]
    assert sched.requests["a"].output_token_ids == [7]


def test_prefill_chunks_are_mixed_with_running_decodes():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 3))
    step(sched)
    sched.add_request(make_request("b", 20))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert out.total_num_scheduled_tokens == 8


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    sched = make_scheduler(max_num_batched_tokens=10, chunked=False)
    sched.add_request(make_request("a", 3, max_tokens=3))
    step(sched)
    sched.add_request(make_request("b", 10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    step(sched)  # a finishes here
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"b": 10}


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = make_scheduler(max_num_batched_tokens=32, threshold=3)
    sched.add_request(make_request("a", 10))
    assert [step(sched)[0].num_scheduled_tokens["a"] for _ in range(4)] == [3, 3, 3, 1]


def test_max_num_seqs_caps_the_requests_of_a_step():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert len(sched.waiting) == 1


def test_running_requests_are_served_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 4))
    step(sched)
    sched.add_request(make_request("b", 4, arrival=-1.0, priority=-5))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}


def test_new_block_ids_list_only_the_blocks_appended_this_step():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", 7))
    out, _ = step(sched)
    first = out.scheduled_new_reqs[0].block_ids
    assert len(first) == 2
    out, _ = step(sched)  # token 8 fits the second block
    assert [list(b) for b in out.scheduled_cached_reqs.new_block_ids] == [[]]
    out, _ = step(sched)  # token 9 needs a third block
    (new,) = out.scheduled_cached_reqs.new_block_ids
    assert len(new) == 1 and sched.kv_cache_manager.get_block_ids("a") == first + list(new)


def test_a_prompt_of_exactly_max_model_len_samples_one_token_and_stops():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", 16))
    out, eco = step(sched)
    assert out.num_scheduled_tokens == {"a": 16}
    assert by_id(eco)["a"].finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------------ priority and preemption


def test_priority_policy_admits_lowest_priority_value_first_then_earliest_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add_request(make_request("lax", 3, arrival=0.0, priority=1, max_tokens=1))
    sched.add_request(make_request("urgent-late", 3, arrival=2.0, priority=0, max_tokens=1))
    sched.add_request(make_request("urgent-early", 3, arrival=1.0, priority=0, max_tokens=1))
    order = [next(iter(step(sched)[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["urgent-early", "urgent-late", "lax"]


def test_fcfs_policy_ignores_priority():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("first", 3, arrival=0.0, priority=9, max_tokens=1))
    sched.add_request(make_request("second", 3, arrival=1.0, priority=0, max_tokens=1))
    assert list(step(sched)[0].num_scheduled_tokens) == ["first"]


def _fill_cache(policy, specs):
    """Three 3-token requests fill a cache of six 2-token blocks; each decode needs a third."""
    sched = make_scheduler(num_blocks=7, block_size=2, policy=policy)
    for rid, arrival, priority, *max_tokens in specs:
        prompt = [ord(rid)] * 3  # distinct prompts: no shared prefix blocks
        sched.add_request(make_request(rid, prompt, arrival=arrival, priority=priority,
                                       max_tokens=max_tokens[0] if max_tokens else 100))
    step(sched)  # prompts: 3 x 2 blocks = all 6 usable blocks
    step(sched)  # the first decodes still fit the second blocks
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    return sched


def test_preemption_picks_the_lowest_priority_then_latest_arrival():
    sched = _fill_cache("priority", [("a", 0.0, 0), ("b", 1.0, 1), ("c", 2.0, 0)])
    out, _ = step(sched)  # each needs a third block: one request must go
    assert out.preempted_req_ids == {"b"}
    assert set(out.num_scheduled_tokens) == {"a", "c"}
    victim = sched.requests["b"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("b") == [] and sched.waiting.peek() is victim
    assert sched.make_stats().num_preemptions == 1


def test_fcfs_preemption_picks_the_latest_arrival():
    sched = _fill_cache("fcfs", [("a", 0.0, 0), ("b", 2.0, 0), ("c", 1.0, 0)])
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}


def test_preempted_request_resumes_as_a_new_request_with_its_generated_tokens():
    sched = _fill_cache("fcfs", [("a", 0.0, 0, 3), ("b", 1.0, 0, 3), ("c", 2.0, 0)])
    out, _ = step(sched)  # c is preempted; a and b finish
    assert out.preempted_req_ids == {"c"}
    out, eco = step(sched)
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == "c" and resumed.prompt_token_ids == [ord("c")] * 3
    assert resumed.output_token_ids == [7, 7]
    # a and b took c's freed blocks for their decodes, so c recomputes all 5 tokens.
    assert resumed.num_computed_tokens == 0 and out.num_scheduled_tokens == {"c": 5}
    assert [o.new_token_ids for o in eco.all_outputs()] == [[7]]
    assert sched.requests["c"].num_preemptions == 1


def test_a_step_that_preempts_admits_no_waiting_request():
    sched = _fill_cache("fcfs", [("a", 0.0, 0), ("b", 1.0, 0), ("c", 2.0, 0)])
    sched.add_request(make_request("d", 1))
    out, _ = step(sched)
    assert out.preempted_req_ids and "d" not in out.num_scheduled_tokens


# ------------------------------------------------------------------ stop conditions


STOP_CASES = {
    # behaviour: (sampling params, sampled tokens, streamed tokens, finish, stop_reason)
    "eos_stops_with_no_stop_reason": ({}, [5, 2, 9], [5, 2], "STOP", None),
    "ignore_eos_generates_past_eos": ({"ignore_eos": True, "max_tokens": 3}, [2, 2, 2, 2],
                                      [2, 2, 2], "LENGTH", None),
    "stop_token_id_stops_and_is_the_stop_reason": ({"stop_token_ids": [8]}, [5, 8, 9],
                                                   [5, 8], "STOP", 8),
    "min_tokens_delays_eos_and_stop_token_ids": ({"stop_token_ids": [8], "min_tokens": 3},
                                                 [2, 8, 8, 9], [2, 8, 8], "STOP", 8),
    "max_tokens_caps_the_output": ({"max_tokens": 4}, [1] * 9, [1] * 4, "LENGTH", None),
    "eos_on_the_last_allowed_token_is_stop_not_length": ({"max_tokens": 2}, [1, 2, 3],
                                                         [1, 2], "STOP", None),
}


@pytest.mark.parametrize("case", STOP_CASES, ids=list(STOP_CASES))
def test_stop_conditions(case):
    params, sampled, streamed, finish, stop_reason = STOP_CASES[case]
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, eos=2, **params))
    it, seen = iter(sampled), []
    while sched.has_unfinished_requests():
        _, eco = step(sched, token=lambda _rid: next(it))
        for o in eco.all_outputs():
            seen += o.new_token_ids
            last = o
    assert seen == streamed
    assert last.finish_reason == FinishReason[finish] and last.stop_reason == stop_reason


def test_max_model_len_caps_prompt_plus_output():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 5, max_tokens=100))
    total = []
    it = iter([1] * 10)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert sched.requests["a"].num_computed_tokens <= 8  # counts this step's tokens
        eco = sched.update_from_output(out, sample_all(sched, out, lambda _rid: next(it)))
        for o in eco.all_outputs():
            total += o.new_token_ids
            last = o
    assert len(total) == 3 and last.finish_reason == FinishReason.LENGTH


def test_max_request_tokens_is_bounded_by_the_cache_and_max_model_len():
    assert make_scheduler(num_blocks=5, block_size=4, max_model_len=64).max_request_tokens == 16
    assert make_scheduler(num_blocks=64, block_size=4, max_model_len=20).max_request_tokens == 20


# ------------------------------------------------------------------ outputs, aborts, stats


def test_abort_frees_blocks_leaves_the_queues_and_reports_the_id_next_step():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 5))
    sched.add_request(make_request("wait", 5))
    step(sched)
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_free_blocks() == 63
    assert not sched.has_unfinished_requests() and sched.requests == {}
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and out.total_num_scheduled_tokens == 0
    assert sched.schedule().finished_req_ids == set()


def test_request_aborted_while_its_step_runs_gets_no_output():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    out = sched.schedule()
    runner_out = sample_all(sched, out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_out).all_outputs() == []


def test_pooling_request_finishes_after_its_prompt_with_the_pooled_output():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("p", 6, pooling=True))
    out = sched.schedule()
    assert sched.update_from_output(out, sample_all(sched, out)).all_outputs() == []
    out = sched.schedule()
    eco = sched.update_from_output(out, sample_all(sched, out, pooled={"p": [0.5, 0.25]}))
    (o,) = eco.all_outputs()
    assert o.pooling_output == [0.5, 0.25] and o.finish_reason == FinishReason.STOP
    assert o.new_token_ids == [] and not sched.has_unfinished_requests()


def test_logprobs_row_goes_only_to_requests_that_asked_for_it():
    sched = make_scheduler()
    sched.add_request(make_request("with", 3, logprobs=1))
    sched.add_request(make_request("without", 3))
    out = sched.schedule()
    lp = LogprobsLists([[7, 1], [7, 2]], [[-0.1, -2.0], [-0.2, -3.0]], [1, 1])
    outs = by_id(sched.update_from_output(out, sample_all(sched, out, logprobs=lp)))
    index = {"with": 0, "without": 1}
    assert outs["with"].new_logprobs == lp.slice(index["with"], index["with"] + 1)
    assert outs["without"].new_logprobs is None


def test_prompt_logprobs_of_a_partial_chunk_are_forwarded():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 10, prompt_logprobs=0))
    out = sched.schedule()
    plp = LogprobsLists([[101], [102], [103]], [[-1.0], [-1.0], [-1.0]], [1, 1, 1])
    (o,) = sched.update_from_output(out, sample_all(sched, out, prompt_logprobs={"a": plp})
                                    ).all_outputs()
    assert o.new_prompt_logprobs == plp and o.new_token_ids == [] and not o.finished


def test_repeated_prompt_reports_its_prefix_cache_hit():
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", 10, max_tokens=1))
    _, eco = step(sched)
    assert by_id(eco)["a"].num_cached_tokens == 0
    sched.add_request(make_request("b", 10, max_tokens=1))
    out, eco = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 2}
    assert by_id(eco)["b"].num_cached_tokens == 8
    stats = eco.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_stats_report_queues_usage_and_the_last_step_token_counts():
    sched = make_scheduler(num_blocks=9, block_size=4, max_num_seqs=1)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 6))
    _, eco = step(sched)
    s = eco.scheduler_stats
    assert (s.num_running_reqs, s.num_waiting_reqs) == (1, 1)
    assert (s.num_prompt_tokens, s.num_generation_tokens) == (6, 1)
    assert s.kv_cache_usage == pytest.approx(2 / 8)
    _, eco = step(sched)
    assert (eco.scheduler_stats.num_prompt_tokens, eco.scheduler_stats.num_generation_tokens) \
        == (0, 1)


def test_duplicate_ids_and_requests_that_can_never_fit_are_rejected():
    sched = make_scheduler(num_blocks=5, block_size=4)
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="more than one request can hold"):
        sched.add_request(make_request("b", 17))
    assert set(sched.requests) == {"a"}


def test_reset_prefix_cache_succeeds_only_when_idle():
    sched = make_scheduler()
    sched.add_request(make_request("a", 9, max_tokens=1))
    sched.schedule()
    assert not sched.reset_prefix_cache()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.reset_prefix_cache()


@pytest.mark.parametrize("vectorized", [False, True])
def test_a_request_that_fails_in_the_update_ends_with_an_error_and_the_batch_carries_on(
        vectorized):
    """Defence in depth: the core's update never dies from one request's state."""
    sched = make_scheduler()
    sched.vectorized = vectorized
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.add_request(make_request("good", 4, max_tokens=3))
    sched.add_request(make_request("bad", 4, max_tokens=3, logprobs=1))

    def corrupt(*_args):
        raise RuntimeError("corrupt request state")

    sched.requests["bad"].check_stop = corrupt
    out = sched.schedule()
    runner_out = sample_all(sched, out, logprobs=LogprobsLists([[7], [7]], [[-0.5], [-0.5]],
                                                               [1, 1]))
    outs = by_id(sched.update_from_output(out, runner_out))
    assert outs["bad"].finish_reason == FinishReason.ERROR
    assert "bad" not in sched.requests and "good" in sched.requests
    assert outs["good"].new_token_ids == [7] and outs["good"].finish_reason is None
    tokens = [7]
    while sched.has_unfinished_requests():
        tokens += by_id(step(sched)[1])["good"].new_token_ids
    assert tokens == [7, 7, 7]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free


# ------------------------------------------------------------------ property tests

VOCAB, EOS = 16, 0


def fake_token(rid: str, pos: int) -> int:
    """The token a deterministic model samples at `pos`: scheduling cannot change it."""
    return zlib.crc32(f"{rid}:{pos}".encode()) % VOCAB


def expected_output(req: Request, cap: int) -> tuple[list[int], FinishReason]:
    params, out = req.sampling_params, []
    while True:
        tok = fake_token(req.request_id, req.num_prompt_tokens + len(out))
        out.append(tok)
        if len(out) >= params.min_tokens:
            if not params.ignore_eos and tok == req.eos_token_id:
                return out, FinishReason.STOP
            if tok in params.stop_token_ids:
                return out, FinishReason.STOP
        if len(out) >= req.max_tokens or req.num_prompt_tokens + len(out) >= cap:
            return out, FinishReason.LENGTH


class FakeRunner:
    """Keeps its own rows as a model runner does, 'writes' token ids into a simulated
    paged KV cache, and checks that every request reads back its own tokens: in each
    KV cache group, those its step's queries see (a sliding window's group: the
    window's)."""

    def __init__(self, sched: Scheduler):
        self.bs = sched.block_size
        self.windows = sched.kv_cache_manager.windows
        self.rows: dict[str, dict] = {}
        self.kv: dict[int, dict[int, int]] = {}
        self.seen_tokens: dict[str, list[int]] = {}

    def per_group(self, block_ids) -> list[list[int]]:
        """The scheduler's block ids, one equal run per group, as per-group lists."""
        n = len(block_ids) // len(self.windows)
        return [list(block_ids[g * n:(g + 1) * n]) for g in range(len(self.windows))]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows
            tokens = new.prompt_token_ids + new.output_token_ids
            if new.output_token_ids:  # resumed after preemption: nothing lost
                assert tokens == self.seen_tokens[new.req_id]
            self.rows[new.req_id] = {"tokens": tokens, "computed": new.num_computed_tokens,
                                     "blocks": self.per_group(new.block_ids)}
            self.seen_tokens[new.req_id] = tokens
        cached = out.scheduled_cached_reqs
        for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                         cached.num_computed_tokens, strict=True):
            row = self.rows[rid]
            assert row["computed"] == computed
            for table, more in zip(row["blocks"], self.per_group(blocks), strict=True):
                table += more
        # Write every scheduled token's KV first (as the real step does), then read.
        for rid, n in out.num_scheduled_tokens.items():
            row = self.rows[rid]
            assert row["computed"] + n <= len(row["tokens"])
            for table in row["blocks"]:
                assert len(table) * self.bs >= row["computed"] + n
                for pos in range(row["computed"], row["computed"] + n):
                    block = table[pos // self.bs]
                    assert block != 0
                    self.kv.setdefault(block, {})[pos % self.bs] = row["tokens"][pos]
        req_ids, sampled = list(out.num_scheduled_tokens), []
        for rid in req_ids:
            row = self.rows[rid]
            before = row["computed"]
            row["computed"] += out.num_scheduled_tokens[rid]
            for table, window in zip(row["blocks"], self.windows, strict=True):
                # The step's first query sits at `before` and sees keys after before - W.
                start = 0 if window is None else max(0, before - window + 1)
                kv = [self.kv[table[p // self.bs]][p % self.bs]
                      for p in range(start, row["computed"])]
                assert kv == row["tokens"][start:row["computed"]], f"{rid} reads foreign KV"
            if row["computed"] == len(row["tokens"]):
                tok = fake_token(rid, len(row["tokens"]))
                row["tokens"].append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


def check_blocks(sched: Scheduler) -> None:
    mgr = sched.kv_cache_manager
    pool = mgr.block_pool
    usable = pool.blocks[1:]
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    owned = sum(1 for b in usable if b.ref_cnt > 0)
    free_list = list(pool.free_block_queue)
    assert len(free_list) == pool.get_num_free_blocks()
    assert all(b.ref_cnt == 0 and not b.is_null for b in free_list)
    assert pool.get_num_free_blocks() + owned == sched.num_blocks - 1
    # Every group's tables; a sliding window's group holds the null block in place of
    # those it let go, and no more than its window and a step's tokens need.
    holders = Counter(b.block_id for table in mgr.tables for blocks in table.values()
                      for b in blocks if not b.is_null)
    assert 0 not in holders
    assert all(pool.blocks[i].ref_cnt == n for i, n in holders.items())
    assert owned == len(holders)
    running = {r.request_id for r in sched.running}
    assert set(mgr.req_to_blocks) <= running
    for req in sched.running:
        num_needed = -(-req.num_computed_tokens // sched.block_size)
        for table, window in zip(mgr.tables, mgr.windows, strict=True):
            blocks = table[req.request_id]
            assert len(blocks) == num_needed
            if window is not None:
                held = sum(not b.is_null for b in blocks)
                assert held <= -(-(window - 1 + sched.max_num_batched_tokens)
                                 // sched.block_size) + 1
                # The nulls lead: the window's blocks are all real.
                assert all(not b.is_null for b in blocks[len(blocks) - held:])
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
               for r in sched.waiting)


@st.composite
def workloads(draw):
    w = scheduler_shapes(draw, max_pool_tokens=32, max_num_seqs=5)
    # KV cache groups: one full-attention group, or full attention beside sliding
    # windows (vLLM's hybrid manager), with a pool as many times larger.
    w["windows"] = draw(st.sampled_from([(None,), (None,), (None, 3), (None, 5, 2)]))
    w["num_blocks"] *= len(w["windows"])
    return w


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans(), st.booleans())
def test_random_workloads_keep_blocks_budgets_and_outputs_intact(w, run_ahead, vectorized):
    """Random arrivals, aborts, preemption and prefix sharing; with `run_ahead` the next
    step is scheduled before the last one's tokens are applied, as EngineCore does with
    async scheduling; `vectorized` off plans every step one request at a time."""
    rng = random.Random(w["seed"])
    sched = make_scheduler(num_blocks=w["num_blocks"], block_size=w["block_size"],
                           max_model_len=w["max_model_len"], max_num_seqs=w["max_num_seqs"],
                           max_num_batched_tokens=w["max_num_batched_tokens"],
                           chunked=w["chunked"], policy=w["policy"], threshold=w["threshold"],
                           caching=w["caching"], windows=w["windows"])
    sched.vectorized = vectorized
    sched.check_invariants = True
    cap = sched.max_request_tokens
    bases = [[rng.randrange(1, VOCAB) for _ in range(cap)] for _ in range(3)]
    pending = []
    for i in range(w["num_requests"]):
        length = rng.randint(1, cap)
        shared = rng.choice([0, length, rng.randint(0, length)])
        prompt = rng.choice(bases)[:shared] + [rng.randrange(1, VOCAB)
                                               for _ in range(length - shared)]
        req = make_request(
            f"r{i}", prompt, eos=EOS, arrival=float(i), priority=rng.randint(0, 2),
            max_tokens=rng.randint(2, 12), ignore_eos=rng.random() < 0.2,
            min_tokens=rng.choice([0, 0, 2]), stop_token_ids=rng.choice([[], [3]]))
        pending.append((rng.randint(0, 8), req))
    pending.sort(key=lambda p: p[0])
    reqs = {r.request_id: r for _, r in pending}
    runner = FakeRunner(sched)
    streamed: dict[str, list[int]] = {rid: [] for rid in reqs}
    finish: dict[str, FinishReason] = {}
    aborted, just_finished = set(), set()
    inflight = None

    def apply(step):
        out, runner_out = step
        live = sorted(r for r in out.num_scheduled_tokens if r in sched.requests)
        if rng.random() < w["abort_rate"] and live:
            rid = rng.choice(live)  # lands while the step runs
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
            just_finished.add(rid)
        eco = sched.update_from_output(out, runner_out)
        for o in eco.all_outputs():
            assert o.request_id not in aborted
            streamed[o.request_id] += o.new_token_ids
            if o.finished:
                finish[o.request_id] = o.finish_reason
                just_finished.add(o.request_id)
                assert sched.kv_cache_manager.get_block_ids(o.request_id) == []
        check_blocks(sched)

    for step_no in range(600):
        while pending and pending[0][0] <= step_no:
            sched.add_request(pending.pop(0)[1])
        if not pending and not sched.has_unfinished_requests() and inflight is None:
            break
        if rng.random() < w["abort_rate"] and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            assert sched.kv_cache_manager.get_block_ids(rid) == []
            aborted.add(rid)
            just_finished.add(rid)
        dispatched = None
        if sched.has_unfinished_requests():
            out = sched.schedule()
            assert just_finished <= out.finished_req_ids
            just_finished = set()
            counts = out.num_scheduled_tokens
            assert out.total_num_scheduled_tokens == sum(counts.values())
            assert out.total_num_scheduled_tokens <= w["max_num_batched_tokens"]
            assert len(counts) <= w["max_num_seqs"] and all(n > 0 for n in counts.values())
            assert all(reqs[r].num_computed_tokens <= w["max_model_len"] for r in counts)
            check_blocks(sched)
            dispatched = (out, runner.execute(out))
        if inflight is not None:
            apply(inflight)
        inflight = dispatched
        if not run_ahead and inflight is not None:
            apply(inflight)
            inflight = None
    else:
        pytest.fail("the workload did not drain: the scheduler livelocked")

    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == sched.num_blocks - 1
    stats = sched.make_stats()
    event(f"preemptions: {min(stats.num_preemptions, 1)}")
    event(f"prefix hits: {min(stats.prefix_cache_hits, 1)}")
    event(f"aborted: {min(len(aborted), 1)}")
    assert sched.kv_cache_manager.req_to_blocks == {}
    assert all(table == {} for table in sched.kv_cache_manager.tables)  # every group's
    assert not sched.waiting and not sched.running
    for rid, req in reqs.items():
        if rid in aborted:
            continue
        tokens, reason = expected_output(req, cap)
        assert streamed[rid] == tokens, f"{rid} (preempted {req.num_preemptions}x)"
        assert finish[rid] == reason


@settings(max_examples=30, deadline=None)
@given(prompt_len=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 8]))
def test_repeated_prompts_hit_every_full_block_but_the_last_token(prompt_len, block_size):
    sched = make_scheduler(block_size=block_size, max_model_len=64)
    for rid in ("first", "again"):
        sched.add_request(make_request(rid, prompt_len, max_tokens=2))
        hit = None
        while sched.has_unfinished_requests():
            _, eco = step(sched)
            hit = by_id(eco).get(rid, None) or hit
        assert hit.num_cached_tokens == (0 if rid == "first"
                                         else (prompt_len - 1) // block_size * block_size)


def test_decode_tokens_go_out_compact_after_each_requests_first():
    """A token that is neither a request's first nor its last travels in two plain
    lists, not as an output object; `all_outputs()` makes the objects on the reader's
    side, marking the prefix-cache count as already reported (-1)."""
    import msgspec

    from jaxllm.core.messages import EngineCoreOutputs

    sched = make_scheduler()
    for rid in "ab":
        sched.add_request(make_request(rid, 6, max_tokens=3))
    _, eco = step(sched)  # first tokens: explicit, with the prefix-cache hits (b: a's block)
    assert eco.token_req_ids is None
    assert sorted((o.request_id, o.num_cached_tokens) for o in eco.outputs) == [("a", 0), ("b", 4)]
    _, eco = step(sched, token=8)
    assert eco.outputs == [] and eco.token_req_ids == ["a", "b"] and eco.token_ids == [8, 8]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(eco), type=EngineCoreOutputs)
    outs = wire.all_outputs()
    assert [(o.request_id, o.new_token_ids, o.num_cached_tokens, o.finished) for o in outs] == [
        ("a", [8], -1, False), ("b", [8], -1, False)]
    assert wire.token_req_ids is None and wire.all_outputs() == outs  # made once
    _, eco = step(sched, token=9)  # max_tokens: the last token is explicit, finished
    assert eco.token_req_ids is None
    assert [(o.new_token_ids, o.finish_reason) for o in eco.outputs] == [
        ([9], FinishReason.LENGTH)] * 2
