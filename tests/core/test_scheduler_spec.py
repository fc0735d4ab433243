"""The scheduler with speculative decoding against the scheduler without it.

Speculating requests take the per-request path (`Scheduler.vectorized` is off
while speculation is on). A fake runner drafts k tokens per request, each the
request's true next token or not at random, accepts the longest correct
prefix and emits one more token, as a verify step does. Whatever the drafts,
every request must end with the tokens, finish reason and logprob rows that
the scheduler without speculation gives it, under chunked prefill, prefix
caching and preemption, with the running batch's invariants checked at every
step and every block back in the pool at the end.
"""

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxllm.config import (
    SpeculativeConfig,
)
from jaxllm.core.messages import LogprobsLists
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.core.scheduler import Scheduler
from tests.core.scheduler_workloads import scheduler_shapes
from tests.core.test_scheduler_paths import (
    VOCAB,
    Runner,
    fake_token,
    make_requests,
    make_scheduler,
    random_spec,
)


def make_spec_scheduler(w: dict) -> Scheduler:
    # Speculating requests take the per-request path.
    return make_scheduler(w, vectorized=False,
                          speculative_config=SpeculativeConfig(num_speculative_tokens=w["k"]))


class DraftingRunner:
    """Verifies drafts against the fake tokens and proposes the next ones: each draft
    is the true token with probability `hit_rate`."""

    def __init__(self, k: int, hit_rate: float, rng: random.Random):
        self.k, self.hit_rate, self.rng = k, hit_rate, rng
        self.rows: dict[str, dict] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.rows[new.req_id] = {
                "tokens": new.prompt_token_ids + new.output_token_ids,
                "prompt": len(new.prompt_token_ids), "pooling": new.pooling_params is not None}
        before = dict(zip(out.scheduled_cached_reqs.req_ids,
                          out.scheduled_cached_reqs.num_computed_tokens.tolist(), strict=True))
        before.update({n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs})
        sampled, proposals, lp_rows, pooled = [], [], [], {}
        for rid, n in zip(out.req_ids, out.num_tokens.tolist(), strict=True):
            row = self.rows[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            end = before[rid] + n - len(drafts)  # the known tokens computed
            emitted, nxt = [], []
            if row["pooling"]:
                if end >= row["prompt"]:
                    pooled[rid] = [1.0]
            elif end == len(row["tokens"]):
                pos = len(row["tokens"])
                for d in drafts:
                    if d != fake_token(rid, pos):
                        break
                    emitted.append(d)
                    pos += 1
                emitted.append(fake_token(rid, pos))
                row["tokens"] += emitted
                pos = len(row["tokens"])
                nxt = [fake_token(rid, pos + j) if self.rng.random() < self.hit_rate
                       else (fake_token(rid, pos + j) + 1) % VOCAB for j in range(self.k)]
            sampled.append(emitted)
            proposals.append(nxt)
            lp_rows.append(len(emitted))
        starts = [sum(lp_rows[:i]) for i in range(len(lp_rows))]
        flat = [t for s in sampled for t in s]
        return ModelRunnerOutput(
            list(out.req_ids), sampled,
            logprobs=LogprobsLists([[t] for t in flat], [[-1.0]] * len(flat), [1] * len(flat)),
            pooler_output=pooled,
            logprob_rows=starts, spec_token_ids=proposals)


def drain(sched: Scheduler, spec: list, execute) -> dict[str, tuple]:
    """Runs the workload synchronously; returns each request's (tokens, finish reason,
    stop reason, logprob rows)."""
    spec = list(spec)
    results: dict[str, list] = {}
    for step_no in range(2000):
        while spec and spec[0][0] <= step_no:
            sched.add_request(make_requests([spec.pop(0)[1]])[0])
        if not spec and not sched.has_unfinished_requests():
            break
        if not sched.has_unfinished_requests():
            continue
        so = sched.schedule()
        for o in sched.update_from_output(so, execute(so)).all_outputs():
            r = results.setdefault(o.request_id, [[], None, None, 0])
            r[0] += o.new_token_ids
            r[3] += len(o.new_logprobs.token_ids) if o.new_logprobs is not None else 0
            if o.finish_reason is not None:
                r[1], r[2] = o.finish_reason, o.stop_reason
    else:
        raise AssertionError("the workload did not drain")
    assert sched.kv_cache_manager.usage == 0.0
    return {rid: tuple(r) for rid, r in results.items()}


@st.composite
def workloads(draw):
    return dict(scheduler_shapes(draw, max_pool_tokens=40, max_num_seqs=6), abort_rate=0.0,
                extras_rate=draw(st.sampled_from([0.0, 0.1])), k=draw(st.integers(1, 4)),
                hit_rate=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_speculating_scheduler_ends_every_request_as_without_speculation(w):
    rng = random.Random(w["seed"])
    ref = make_scheduler(w, True)
    spec = random_spec(w, ref.max_request_tokens, rng)
    runner = Runner(ref)
    want = drain(ref, spec, lambda so: runner.execute(so, False))
    sched = make_spec_scheduler(w)
    drafting = DraftingRunner(w["k"], w["hit_rate"], random.Random(w["seed"] + 1))
    stats = []
    make_stats = sched.make_stats

    def recording():
        out = make_stats()
        stats.append(out.spec_decoding_stats)
        return out

    sched.make_stats = recording
    got = drain(sched, spec, drafting.execute)
    assert got == want
    accepted = sum(s.num_accepted_tokens for s in stats if s is not None)
    event(f"drafts accepted: {min(accepted, 1)}")
    event(f"preemptions: {min(sched.num_preemptions, 1)}")
