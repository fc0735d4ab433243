"""EngineCore: the loop body the scheduler and the model runner turn together.

`step()` = schedule -> execute_model -> update_from_output. The core never
tokenizes or detokenizes; it speaks EngineCoreRequest in, EngineCoreOutputs out.
"""

from __future__ import annotations

import logging
import time

from jaxllm.config import EngineConfig
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        from jaxllm.worker.model_runner import ModelRunner

        self.config = config
        t0 = time.perf_counter()
        self.model_runner = ModelRunner(config)
        if config.precompile:
            self.model_runner.precompile()
        self.scheduler = Scheduler(config)
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine core ready: %d KV blocks of %d tokens, started in %.1fs",
                    config.cache_config.num_blocks - 1, config.cache_config.block_size,
                    self.startup_seconds)

    @property
    def max_request_tokens(self) -> int:
        return self.scheduler.max_request_tokens

    def add_request(self, request: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queues a request; returns an error output instead if it can never run."""
        need = len(request.prompt_token_ids)
        if need >= self.max_request_tokens:
            logger.warning("rejecting %s: %d prompt tokens, at most %d fit", request.request_id,
                           need, self.max_request_tokens)
            return EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                    stop_reason="prompt does not fit in the KV cache")
        self.scheduler.add_request(Request.from_engine_core_request(request))
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(),
                                     timestamp=time.monotonic())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.timestamp = time.monotonic()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        pass

