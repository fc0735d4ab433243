"""The scheduler's array path (RunningBatch.schedule_running / apply_sampled) against its
per-request path (`vectorized = False`): identical SchedulerOutputs, engine outputs and
stats at every step of random workloads."""

import random
import zlib

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from jaxllm.core.messages import EngineCoreOutputs, LogprobsLists, SchedulerStats
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.core.scheduler import Scheduler
from jaxllm.sampling_params import PoolingParams, SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from tests.core.scheduler_workloads import scheduler_shapes

VOCAB, EOS = 16, 0


def make_scheduler(w: dict, vectorized: bool,
                   speculative_config: SpeculativeConfig | None = None) -> Scheduler:
    model = ModelConfig(model="fake", tokenizer="fake", dtype="float32",
                        max_model_len=w["max_model_len"], seed=0, skip_tokenizer_init=True,
                        load_format="dummy", served_model_name="fake", hf_config=None)
    sched = Scheduler(EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=w["block_size"], enable_prefix_caching=w["caching"],
                                 num_blocks=w["num_blocks"],
                                 group_windows=w.get("windows", (None,))),
        scheduler_config=SchedulerConfig(
            max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["max_num_batched_tokens"],
            max_model_len=w["max_model_len"], enable_chunked_prefill=w["chunked"],
            policy=w["policy"], long_prefill_token_threshold=w["threshold"]),
        parallel_config=ParallelConfig(), speculative_config=speculative_config))
    sched.vectorized = vectorized
    sched.check_invariants = True
    return sched


def fake_token(rid: str, pos: int) -> int:
    return zlib.crc32(f"{rid}:{pos}".encode()) % VOCAB


class Runner:
    """A deterministic model runner: each request's token at a position is fixed, so
    both schedulers must see the same tokens for the same SchedulerOutput."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.rows: dict[str, dict] = {}

    def execute(self, out: SchedulerOutput, as_array: bool) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.rows[new.req_id] = {
                "tokens": new.prompt_token_ids + new.output_token_ids,
                "computed": new.num_computed_tokens, "prompt": len(new.prompt_token_ids),
                "pooling": new.pooling_params is not None,
                "logprobs": new.sampling_params is not None
                and new.sampling_params.logprobs is not None}
        sampled, pooled, want_logprobs = [], {}, False
        for rid, n in zip(out.req_ids, out.num_tokens.tolist(), strict=True):
            row = self.rows[rid]
            row["computed"] += n
            want_logprobs |= row["logprobs"]
            if row["pooling"]:
                if row["computed"] >= row["prompt"]:
                    pooled[rid] = [float(row["computed"])]
                sampled.append([])
            elif row["computed"] == len(row["tokens"]):
                tok = fake_token(rid, len(row["tokens"]))
                row["tokens"].append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        logprobs = None
        if want_logprobs:
            firsts = [s[0] if s else -1 for s in sampled]
            logprobs = LogprobsLists([[t] for t in firsts], [[-1.0]] * len(firsts),
                                     [1] * len(firsts))
        if as_array and not pooled:
            array = np.array([s[0] if s else -1 for s in sampled], np.int64)
            return ModelRunnerOutput(list(out.req_ids), None, logprobs=logprobs,
                                     sampled_array=array)
        return ModelRunnerOutput(list(out.req_ids), sampled, logprobs=logprobs,
                                 pooler_output=pooled)


def sched_output_key(out: SchedulerOutput) -> tuple:
    """Every field of a SchedulerOutput, arrays as (dtype, values)."""
    cached = out.scheduled_cached_reqs
    return (
        [(n.req_id, n.prompt_token_ids, n.output_token_ids, n.sampling_params,
          n.pooling_params, n.block_ids, n.num_computed_tokens, n.prompt_logprobs_from)
         for n in out.scheduled_new_reqs],
        cached.req_ids, [list(b) for b in cached.new_block_ids],
        (str(cached.num_computed_tokens.dtype), cached.num_computed_tokens.tolist()),
        out.req_ids, (str(out.num_tokens.dtype), out.num_tokens.tolist()),
        (str(out.samples.dtype), out.samples.tolist()),
        out.total_num_scheduled_tokens, out.finished_req_ids, out.preempted_req_ids)


def assert_same_engine_outputs(fast: EngineCoreOutputs, ref: EngineCoreOutputs) -> None:
    """The array path may send a token compactly (request id and token id) where the
    per-request path sends an output object; everything else is equal."""
    assert fast.scheduler_stats == ref.scheduler_stats
    compact = dict(zip(fast.token_req_ids or (), fast.token_ids or (), strict=True))
    objects = {o.request_id: o for o in fast.outputs}
    assert not compact.keys() & objects.keys()
    ref_ids = [o.request_id for o in ref.outputs]
    assert [r for r in ref_ids if r not in compact] == [o.request_id for o in fast.outputs]
    assert [r for r in ref_ids if r in compact] == list(compact)
    for o in ref.outputs:
        if o.request_id in compact:  # a mid-stream token: nothing else to report
            assert (o.new_token_ids, o.finish_reason, o.new_logprobs, o.new_prompt_logprobs,
                    o.pooling_output) == ([compact[o.request_id]], None, None, None, None)
        else:
            assert objects[o.request_id] == o


def make_requests(spec: list[dict]) -> list[Request]:
    reqs = []
    for s in spec:
        if s["pooling"]:
            reqs.append(Request(s["rid"], s["prompt"], None, PoolingParams(),
                                arrival_time=s["arrival"], priority=s["priority"]))
        else:
            reqs.append(Request(s["rid"], s["prompt"], SamplingParams(**s["params"]),
                                eos_token_id=EOS, arrival_time=s["arrival"],
                                priority=s["priority"]))
    return reqs


@st.composite
def workloads(draw):
    w = dict(scheduler_shapes(draw, max_pool_tokens=40, max_num_seqs=6),
             extras_rate=draw(st.sampled_from([0.0, 0.1])),  # logprobs, pooling
             run_ahead=draw(st.booleans()),
             # KV cache groups: full attention alone, or beside sliding windows
             windows=draw(st.sampled_from([(None,), (None,), (None, 3), (None, 5, 2)])))
    w["num_blocks"] *= len(w["windows"])
    return w


def random_spec(w: dict, cap: int, rng: random.Random) -> list[tuple[int, dict]]:
    bases = [[rng.randrange(1, VOCAB) for _ in range(cap)] for _ in range(3)]
    spec = []
    for i in range(w["num_requests"]):
        length = rng.randint(1, cap)
        shared = rng.choice([0, length, rng.randint(0, length)])  # prefix-cache hits
        prompt = rng.choice(bases)[:shared] + [rng.randrange(1, VOCAB)
                                               for _ in range(length - shared)]
        params = dict(max_tokens=rng.randint(2, 12), ignore_eos=rng.random() < 0.2,
                      min_tokens=rng.choice([0, 0, 2]), stop_token_ids=rng.choice([[], [3]]))
        if rng.random() < w["extras_rate"]:
            params["logprobs"] = 1
        spec.append((rng.randint(0, 8), dict(
            rid=f"r{i}", prompt=prompt, arrival=float(i), priority=rng.randint(0, 2),
            pooling=rng.random() < w["extras_rate"], params=params)))
    spec.sort(key=lambda p: p[0])
    return spec


def count_array_calls(sched: Scheduler) -> dict[str, int]:
    """Counts the array passes `sched` runs (wrapping its running batch's methods)."""
    calls = {"schedule_running": 0, "apply_sampled": 0}
    batch = sched.running
    for name in calls:
        method = getattr(batch, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)
        setattr(batch, name, counted)
    return calls


def run_both(w: dict) -> tuple[dict[str, int], SchedulerStats]:
    """Drives one workload through both paths in lockstep, asserting equal results at
    every step; returns the array path's call counts."""
    rng = random.Random(w["seed"])
    fast, ref = make_scheduler(w, True), make_scheduler(w, False)
    calls = count_array_calls(fast)
    spec = random_spec(w, fast.max_request_tokens, rng)
    runners = (Runner(fast), Runner(ref))
    inflight = None

    def apply(step):
        outs, results = step
        live = sorted(r for r in outs[0].req_ids if r in fast.requests)
        if rng.random() < w["abort_rate"] and live:  # lands while the step runs
            rid = rng.choice(live)
            for s in (fast, ref):
                s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        eco = [s.update_from_output(o, r) for s, o, r in zip((fast, ref), outs, results,
                                                              strict=True)]
        assert_same_engine_outputs(*eco)
        assert sorted(fast.requests) == sorted(ref.requests)

    for step_no in range(600):
        while spec and spec[0][0] <= step_no:
            spec_now = spec.pop(0)[1]
            for s, req in zip((fast, ref), make_requests([spec_now, spec_now]), strict=True):
                s.add_request(req)
        if not spec and not fast.has_unfinished_requests() and inflight is None:
            break
        if rng.random() < w["abort_rate"] and fast.requests:
            rid = rng.choice(sorted(fast.requests))
            for s in (fast, ref):
                s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        dispatched = None
        assert fast.has_unfinished_requests() == ref.has_unfinished_requests()
        if fast.has_unfinished_requests():
            outs = (fast.schedule(), ref.schedule())
            assert sched_output_key(outs[0]) == sched_output_key(outs[1]), f"step {step_no}"
            as_array = rng.random() < 0.5
            results = tuple(r.execute(o, as_array) for r, o in zip(runners, outs, strict=True))
            dispatched = (outs, results)
        if inflight is not None:
            apply(inflight)
        inflight = dispatched
        if not w["run_ahead"] and inflight is not None:
            apply(inflight)
            inflight = None
    else:
        raise AssertionError("the workload did not drain")
    assert fast.make_stats() == ref.make_stats()
    assert not fast.requests and not ref.requests
    return calls, fast.make_stats()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_array_path_and_per_request_path_make_identical_steps(w):
    """Arrivals, prompt lengths, chunked prefill, prefix hits, preemption under a small
    block pool, aborts (between steps and while a step runs), finishes by EOS, stop id
    and length, logprobs and pooling steps, with and without async run-ahead."""
    calls, stats = run_both(w)
    event(f"KV cache groups: {len(w['windows'])}")
    event(f"preemptions: {min(stats.num_preemptions, 1)}")
    event(f"prefix hits: {min(stats.prefix_cache_hits, 1)}")
    event(f"array schedule passes: {min(calls['schedule_running'], 1)}")
    event(f"array update passes: {min(calls['apply_sampled'], 1)}")


def test_the_fast_scheduler_really_runs_the_array_passes():
    """Guards the differential test above: its vectorized side must plan and apply
    steps with the RunningBatch passes, not fall back to the per-request code."""
    w = dict(seed=1, block_size=4, num_blocks=40, max_model_len=40,
             max_num_batched_tokens=24, max_num_seqs=6, chunked=True, threshold=0,
             policy="fcfs", caching=True, num_requests=8, abort_rate=0.0, extras_rate=0.0,
             run_ahead=False)
    calls, _ = run_both(w)
    assert calls["schedule_running"] > 5 and calls["apply_sampled"] > 5

