"""The scheduler runs at most `max_loras` distinct LoRA adapters at once (the device's
adapter slots); a request with another adapter waits, keeping its place in the queue,
while later requests whose adapters fit, and base-model requests, run (as vLLM)."""

from __future__ import annotations

from jaxllm.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import SamplingParams


def make_scheduler(max_loras: int, policy: str = "fcfs") -> Scheduler:
    model = ModelConfig(model="fake", tokenizer="fake", dtype="float32", max_model_len=64,
                        seed=0, skip_tokenizer_init=True, load_format="dummy",
                        served_model_name="fake", hf_config=None)
    return Scheduler(EngineConfig(
        model_config=model, cache_config=CacheConfig(block_size=4, num_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                         max_model_len=64, policy=policy),
        parallel_config=ParallelConfig(), lora_config=LoRAConfig(max_loras=max_loras)))


def _add(sched: Scheduler, specs: list[tuple[str, int | None]], priority: int = 0) -> None:
    for rid, lora_id in specs:
        lora = LoRARequest(f"a{lora_id}", lora_id, f"/a{lora_id}") if lora_id else None
        sched.add_request(Request(rid, [100 + i for i in range(4)],
                                  SamplingParams(max_tokens=8), lora_request=lora,
                                  priority=priority))


def test_a_third_adapter_waits_while_base_requests_behind_it_run_with_max_loras_2():
    sched = make_scheduler(2)
    _add(sched, [("a", 1), ("b", 2), ("c", 3), ("d", None)])
    assert sched.schedule().req_ids == ["a", "b", "d"]  # c is passed over, d is not held up
    assert [r.request_id for r in sched.waiting] == ["c"]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().req_ids == ["b", "d", "c"]


def test_passed_over_requests_keep_their_order_and_later_fitting_adapters_run():
    sched = make_scheduler(2)
    _add(sched, [("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", None), ("f", 1), ("g", 3)])
    # c, d and g find no slot; e (no adapter) and f (adapter 1, running) are admitted.
    assert sched.schedule().req_ids == ["a", "b", "e", "f"]
    assert [r.request_id for r in sched.waiting] == ["c", "d", "g"]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().req_ids == ["b", "e", "f"]  # f still holds adapter 1's slot
    sched.finish_requests(["f"], RequestStatus.FINISHED_ABORTED)
    # Adapter 1's slot is free: c, first in the queue, takes it, and g shares it; d waits.
    assert sched.schedule().req_ids == ["b", "e", "c", "g"]
    assert [r.request_id for r in sched.waiting] == ["d"]


def test_passed_over_requests_keep_their_priority_order():
    sched = make_scheduler(1, policy="priority")
    _add(sched, [("a", 1)], priority=0)
    _add(sched, [("b", 2), ("c", 3)], priority=1)
    _add(sched, [("d", None), ("e", 2)], priority=2)
    assert sched.schedule().req_ids == ["a", "d"]
    assert [r.request_id for r in sched.waiting] == ["b", "c", "e"]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().req_ids == ["d", "b", "e"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_requests_sharing_an_adapter_and_base_requests_all_run_with_max_loras_1():
    sched = make_scheduler(1)
    _add(sched, [("a", 1), ("b", 1), ("c", None), ("d", 1)])
    assert sched.schedule().req_ids == ["a", "b", "c", "d"]
