"""EngineCore: the loop body the scheduler and the model runner turn together.

`step()` = schedule -> execute_model -> update_from_output. The core never
tokenizes or detokenizes; it speaks EngineCoreRequest in, EngineCoreOutputs out.

With async scheduling (the default) a step runs one ahead: it schedules and
dispatches step N+1, then waits for step N's tokens and processes them while
N+1 runs on the device. Tokens sampled by N feed N+1 on the device; the
scheduler holds one output placeholder per token in flight. When a running
request's sampling reads its own output history (penalties, bad words,
min_tokens), the core finishes the step in flight before scheduling the next.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

from jaxllm.config import EngineConfig
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from jaxllm.sampling_params import INT64_MAX, TOKEN_ID_MAX

if TYPE_CHECKING:
    from jaxllm.worker.model_runner import StepHandle

logger = logging.getLogger(__name__)


def freeze_gc() -> None:
    """The garbage-collector policy of a process that runs an engine core.

    What is alive once the engine has started (modules, the model's Python
    objects, compiled executables) lives as long as the process: frozen, the
    collector never scans it again. A step makes and drops hundreds of small
    objects (outputs, token lists); nearly all die by reference counting, so
    the young generation is collected after 50,000 allocations, not 700: with
    the default, collections took a large share of a 256-request step's host time.
    Only for a process the engine owns (freezing keeps a discarded engine's
    cycles alive for good).
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 50_000), gen1, gen2)


class EngineCore:
    def __init__(self, config: EngineConfig):
        from jaxllm.worker.model_runner import ModelRunner

        self.config = config
        t0 = time.perf_counter()
        self.model_runner = ModelRunner(config)
        if config.precompile:
            self.model_runner.precompile()
        # The KV cache's size is known once the runner has measured the device:
        # the scheduler's block pool takes it from here.
        config.cache_config.num_blocks = self.model_runner.num_kv_blocks
        self.scheduler = Scheduler(config)
        self.async_scheduling = config.async_scheduling
        self._inflight: tuple[SchedulerOutput, StepHandle | None] | None = None
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine core ready: %d KV blocks of %d tokens, started in %.1fs",
                    config.cache_config.num_blocks - 1, config.cache_config.block_size,
                    self.startup_seconds)

    @property
    def max_request_tokens(self) -> int:
        return self.scheduler.max_request_tokens

    def add_request(self, request: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queues a request; returns an error output instead if it can never run."""
        bad = self._out_of_range(request)
        if bad is not None:
            logger.warning("rejecting %s: %s", request.request_id, bad)
            return EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                    stop_reason=bad)
        need = len(request.prompt_token_ids)
        if need >= self.max_request_tokens:
            logger.warning("rejecting %s: %d prompt tokens, at most %d fit", request.request_id,
                           need, self.max_request_tokens)
            return EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                    stop_reason="prompt does not fit in the KV cache")
        self.scheduler.add_request(Request.from_engine_core_request(request))
        return None

    def _out_of_range(self, request: EngineCoreRequest) -> str | None:
        """What in the request the core's arrays cannot hold, if anything: the frontend
        checks all of it; this keeps one request that bypassed it from killing the core."""
        vocab = self.config.model_config.vocab_size
        ids = request.prompt_token_ids
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            return f"prompt_token_ids: empty or outside [0, {vocab})"
        if not -INT64_MAX <= request.priority <= INT64_MAX:
            return f"priority: outside [-{INT64_MAX}, {INT64_MAX}]"
        eos = request.eos_token_id
        if eos is not None and not 0 <= eos <= TOKEN_ID_MAX:
            return f"eos_token_id: outside [0, {TOKEN_ID_MAX}]"
        params = request.sampling_params
        if params is not None:
            try:
                params.verify()
            except ValueError as e:
                return str(e)
            # The InputProcessor caps max_tokens to the context; so every count fits int32.
            limit = self.config.model_config.max_model_len
            if params.max_tokens is None or len(ids) + params.max_tokens > limit:
                return f"max_tokens: {params.max_tokens} with {len(ids)} prompt tokens " \
                       f"passes max_model_len {limit}"
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        if self.async_scheduling:
            return self._step_ahead()
        if not self.scheduler.has_unfinished_requests():
            return self._no_outputs()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.timestamp = time.monotonic()
        return outputs

    def _step_ahead(self) -> EngineCoreOutputs:
        outputs = None
        if self._inflight is not None and self.scheduler.needs_output_history():
            outputs = self._finish_inflight()
        dispatched = None
        if self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            dispatched = (so, self.model_runner.dispatch(so))
        if self._inflight is not None:
            outputs = self._finish_inflight()
        self._inflight = dispatched
        return outputs if outputs is not None else self._no_outputs()

    def _finish_inflight(self) -> EngineCoreOutputs:
        so, handle = self._inflight
        self._inflight = None
        outputs = self.scheduler.update_from_output(so, self.model_runner.collect(handle))
        outputs.timestamp = time.monotonic()
        return outputs

    def _no_outputs(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        pass

