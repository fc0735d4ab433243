"""The scheduler of an encoder-only model: whole prompts in one step, no KV blocks."""

from __future__ import annotations

from jaxllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from jaxllm.core.encoder_scheduler import EncoderScheduler
from jaxllm.core.request import RequestStatus
from jaxllm.core.runner_output import ModelRunnerOutput
from tests.core.test_scheduler import make_request


def encoder_scheduler(max_num_seqs: int = 4, budget: int = 32) -> EncoderScheduler:
    model = ModelConfig(model="fake", tokenizer="fake", dtype="float32", max_model_len=32,
                        seed=0, skip_tokenizer_init=True, load_format="dummy",
                        served_model_name="fake", hf_config=None, is_encoder=True,
                        supported_tasks=("embed",))
    return EncoderScheduler(EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=4, enable_prefix_caching=False, num_blocks=2),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=budget, max_model_len=32,
                                         enable_chunked_prefill=False),
        parallel_config=ParallelConfig()))


def pooled(out) -> ModelRunnerOutput:
    return ModelRunnerOutput(list(out.req_ids), [[] for _ in out.req_ids],
                             pooler_output={r: [1.0] for r in out.req_ids})


def test_encoder_requests_run_whole_in_one_step_without_blocks():
    sched = encoder_scheduler()
    # 32 tokens fit one request: a full-context prompt runs though the pool has one block.
    assert sched.max_request_tokens == 32
    for rid, n in (("a", 10), ("b", 20), ("c", 5), ("d", 32)):
        sched.add_request(make_request(rid, n, pooling=True))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        # Every scheduled request is new and computes its whole prompt at once.
        assert [r.req_id for r in out.scheduled_new_reqs] == out.req_ids
        assert all(r.block_ids == [] and r.num_computed_tokens == 0
                   for r in out.scheduled_new_reqs)
        assert out.num_tokens.tolist() == [sched.requests[r].num_prompt_tokens
                                           for r in out.req_ids]
        assert sched.kv_cache_manager.get_num_free_blocks() == 1
        steps.append(out.req_ids)
        outputs = sched.update_from_output(out, pooled(out))
        assert {o.request_id for o in outputs.outputs} == set(out.req_ids)
        assert all(o.pooling_output == [1.0] for o in outputs.outputs)
    # "c" (5) waits behind "b" (20): 10 + 20 leave 2 tokens, and prompts are never cut.
    assert steps == [["a", "b"], ["c"], ["d"]]


def test_encoder_request_scheduled_ahead_is_not_scheduled_again():
    """Async scheduling plans the next step before this one's output returns."""
    sched = encoder_scheduler()
    sched.add_request(make_request("a", 6, pooling=True))
    first = sched.schedule()
    sched.add_request(make_request("b", 7, pooling=True))
    second = sched.schedule()
    assert (first.req_ids, second.req_ids) == (["a"], ["b"])
    sched.update_from_output(first, pooled(first))
    sched.update_from_output(second, pooled(second))
    assert not sched.has_unfinished_requests()
    assert sched.make_stats().kv_cache_usage == 0.0


def test_aborted_encoder_request_frees_nothing_and_leaves():
    sched = encoder_scheduler()
    sched.add_request(make_request("a", 6, pooling=True))
    sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == 1
