"""The scheduler runs at most `max_loras` distinct LoRA adapters at once (the device's
adapter slots); a request with another adapter waits, base-model requests never do."""

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


def make_scheduler(max_loras: int) -> Scheduler:
    model = ModelConfig(model="fake", tokenizer="fake", dtype="float32", max_model_len=64,
                        seed=0, skip_tokenizer_init=True, load_format="dummy",
                        served_model_name="fake", hf_config=None)
    return Scheduler(EngineConfig(
        model_config=model, cache_config=CacheConfig(block_size=4, num_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                         max_model_len=64),
        parallel_config=ParallelConfig(), lora_config=LoRAConfig(max_loras=max_loras)))


def _add(sched: Scheduler, specs: list[tuple[str, int | None]]) -> None:
    for rid, lora_id in specs:
        lora = LoRARequest(f"a{lora_id}", lora_id, f"/a{lora_id}") if lora_id else None
        sched.add_request(Request(rid, [100 + i for i in range(4)],
                                  SamplingParams(max_tokens=8), lora_request=lora))


def test_a_third_adapter_waits_while_two_run_with_max_loras_2():
    sched = make_scheduler(2)
    _add(sched, [("a", 1), ("b", 2), ("c", 3), ("d", None)])
    assert sched.schedule().req_ids == ["a", "b"]  # c waits at the queue's head (FCFS)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().req_ids == ["b", "c", "d"]


def test_requests_sharing_an_adapter_and_base_requests_all_run_with_max_loras_1():
    sched = make_scheduler(1)
    _add(sched, [("a", 1), ("b", 1), ("c", None), ("d", 1)])
    assert sched.schedule().req_ids == ["a", "b", "c", "d"]
