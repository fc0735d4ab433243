"""EngineCore: the loop body the scheduler and the model runner turn together.

`step()` = schedule -> execute_model -> update_from_output. The core never
tokenizes or detokenizes; it speaks EngineCoreRequest in, EngineCoreOutputs out.

With async scheduling (the default) a step runs one ahead: it schedules and
dispatches step N+1, then waits for step N's tokens and processes them while
N+1 runs on the device. Tokens sampled by N feed N+1 on the device; the
scheduler holds one output placeholder per token in flight. Sampling that
reads a request's own outputs (penalties, bad words, min_tokens) reads them on
the device (sample/output_state.py), so it runs ahead too.

Structured outputs keep the step ahead: requests wait here, outside the
scheduler, until their grammar is compiled; a step with constrained requests
launches its forward, then finishes the step in flight (whose tokens advance
the grammars), fills the token bitmask on the host while the forward runs,
and launches the sampler with it.

On host 0 of a multi-host engine the runner is wrapped so that the follower
hosts make each of its device calls too (lockstep.py); nothing else changes.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from typing import TYPE_CHECKING, Any

from jaxllm.config import EngineConfig
from jaxllm.core.encoder_scheduler import EncoderScheduler
from jaxllm.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.core.scheduler import Scheduler
from jaxllm.reasoning import get_reasoning_format
from jaxllm.sampling_params import INT64_MAX, TOKEN_ID_MAX
from jaxllm.structured_output.grammar import make_tokenizer
from jaxllm.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from jaxllm.engine.lockstep import LockstepLeader
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
        if config.model_config.is_encoder:
            from jaxllm.worker.encoder_runner import EncoderModelRunner as ModelRunner
        else:
            from jaxllm.worker.model_runner import ModelRunner

        self.config = config
        t0 = time.perf_counter()
        # Host 0 of a multi-host engine: the followers replay the runner's calls.
        self.lockstep: LockstepLeader | None = None
        spec = config.parallel_config.distributed
        if spec is not None:
            from jaxllm.distributed.multihost import initialize
            from jaxllm.engine.lockstep import LeaderRunner, LockstepLeader

            initialize(spec)
            self.lockstep = LockstepLeader(spec, config)
            self.model_runner = LeaderRunner(ModelRunner(config), self.lockstep)
        else:
            self.model_runner = ModelRunner(config)
        if config.precompile:
            self.model_runner.precompile()
        # The KV cache's size is known once the runner has measured the device:
        # the scheduler's block pool takes it from here.
        config.cache_config.num_blocks = self.model_runner.num_kv_blocks
        groups = getattr(self.model_runner, "kv_groups", None)  # none for an encoder
        config.cache_config.group_windows = groups.windows if groups else (None,)
        self.scheduler = (EncoderScheduler if config.model_config.is_encoder
                          else Scheduler)(config)
        # Speculation steps synchronously: a step's drafts are proposed from the
        # tokens the step before accepted, and how many it accepted sets where the
        # next step's tokens sit, so the next step cannot be planned before it returns.
        self.async_scheduling = config.async_scheduling and config.speculative_config is None
        self._inflight: tuple[SchedulerOutput, StepHandle | None] | None = None
        # Structured outputs: made on the first constrained request.
        self.structured: StructuredOutputManager | None = None
        self._awaiting_grammar: dict[str, Request] = {}
        self._rejected: list[EngineCoreOutput] = []
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
        # A pooling request generates nothing: its prompt may fill the whole context.
        if need > self.max_request_tokens - (request.pooling_params is None):
            logger.warning("rejecting %s: %d prompt tokens, at most %d fit", request.request_id,
                           need, self.max_request_tokens)
            return EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                    stop_reason="prompt does not fit in the KV cache")
        req = Request.from_engine_core_request(request)
        params = request.sampling_params
        if params is not None and params.structured_outputs is not None:
            if req.request_id in self._awaiting_grammar or req.request_id in \
                    self.scheduler.requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self._structured().submit(req.request_id, params.structured_outputs,
                                      request.prompt_token_ids)
            self._awaiting_grammar[req.request_id] = req
            return None
        self.scheduler.add_request(req)
        return None

    def _structured(self) -> StructuredOutputManager:
        if self.structured is None:
            mc = self.config.model_config

            @functools.cache
            def hf_tokenizer() -> Any:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(mc.tokenizer)

            def tokenizer() -> object:
                return make_tokenizer(hf_tokenizer(), mc.vocab_size,
                                      mc.eos_token_ids[0] if mc.eos_token_ids else None)

            tags = None
            if self.config.reasoning_parser is not None:  # the grammar waits out the thinking
                fmt = get_reasoning_format(self.config.reasoning_parser)
                tags = tuple(hf_tokenizer().encode(t, add_special_tokens=False) if t else None
                             for t in (fmt.start, fmt.end, fmt.turn))
            self.structured = StructuredOutputManager(tokenizer, mc.vocab_size,
                                                      reasoning_tags=tags)
        return self.structured

    def _admit_compiled(self) -> None:
        """Moves requests whose grammar is compiled into the scheduler; fails the others."""
        so = self.structured
        if so is None or not so.has_pending():
            return
        if not self.scheduler.has_unfinished_requests() and self._inflight is None:
            so.wait_any(0.05)  # nothing else to do: no busy spin while grammars compile
        ready, failed = so.take_ready()
        for req_id in ready:
            self.scheduler.add_request(self._awaiting_grammar.pop(req_id))
        for req_id, reason in failed.items():
            self._awaiting_grammar.pop(req_id)
            self._rejected.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR,
                                                   stop_reason=reason))

    def _with_bitmask(self, so: SchedulerOutput) -> SchedulerOutput:
        if self.structured is not None and self.structured.matchers:
            so.grammar_bitmask = self.structured.fill_bitmask(so.req_ids, so.samples)
        return so

    def _update(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """update_from_output, then the grammars advance with the tokens sampled."""
        outputs = self.scheduler.update_from_output(so, runner_output)
        st = self.structured
        if st is not None and st.matchers:
            for out in outputs.outputs:
                if out.request_id in st.matchers:
                    st.accept(out.request_id, out.new_token_ids)
            for req_id, token in zip(outputs.token_req_ids or (), outputs.token_ids or (),
                                     strict=True):
                if req_id in st.matchers:
                    st.accept(req_id, [token])
            st.remove([r for r in self.scheduler.finished_req_ids if r in st.matchers])
        if self._rejected:
            outputs.outputs.extend(self._rejected)
            self._rejected = []
        return outputs

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
        if request_ids and self._awaiting_grammar:
            waiting = [r for r in request_ids if r in self._awaiting_grammar]
            for req_id in waiting:
                del self._awaiting_grammar[req_id]
            self.structured.remove(waiting)
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
            if self.structured is not None:
                self.structured.remove(request_ids)

    def step(self) -> EngineCoreOutputs:
        self._admit_compiled()
        if self.async_scheduling:
            return self._step_ahead()
        if not self.scheduler.has_unfinished_requests():
            return self._no_outputs()
        scheduler_output = self._with_bitmask(self.scheduler.schedule())
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self._update(scheduler_output, runner_output)
        outputs.timestamp = time.monotonic()
        return outputs

    def _step_ahead(self) -> EngineCoreOutputs:
        outputs = None
        dispatched = None
        if self.scheduler.has_unfinished_requests():
            so = self.scheduler.schedule()
            if self.structured is not None and self.structured.matchers:
                # The forward runs while the step in flight returns its tokens; the
                # grammars advance with them and fill this step's bitmask, and only
                # then is the sampler launched (unconstrained rows are not held back).
                handle = self.model_runner.dispatch(so, sample=False)
                if self._inflight is not None:
                    outputs = self._finish_inflight()
                self.model_runner.dispatch_sample(handle, self._with_bitmask(so).grammar_bitmask)
            else:
                handle = self.model_runner.dispatch(so)
            dispatched = (so, handle)
        if self._inflight is not None:
            outputs = self._finish_inflight()
        self._inflight = dispatched
        return outputs if outputs is not None else self._no_outputs()

    def _finish_inflight(self) -> EngineCoreOutputs:
        so, handle = self._inflight
        self._inflight = None
        outputs = self._update(so, self.model_runner.collect(handle))
        outputs.timestamp = time.monotonic()
        return outputs

    def _no_outputs(self) -> EngineCoreOutputs:
        outputs, self._rejected = self._rejected, []
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return (self._inflight is not None or self.scheduler.has_unfinished_requests()
                or bool(self._awaiting_grammar) or bool(self._rejected))

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def model_summary(self) -> dict:
        """What a benchmark's roofline reads of the loaded model, from any client: its
        parameter count, the bytes its weights hold as stored (a quantized weight's
        elements and scales), the attention backend's name, and how many processes
        drive the model's devices (several in a multi-host job), and how its
        row-parallel sums run (layers/row_reduce.py: "peer", "psum", or None for XLA's)."""
        import jax

        from jaxllm.worker.weight_stats import param_count, weight_bytes

        runner = self.model_runner
        state = runner.state
        return {"params": param_count(state), "weight_bytes": weight_bytes(state),
                "attention_backend": runner.attn_backend.name,
                "num_processes": jax.process_count(),
                "row_reduce": runner.row_reduce and runner.row_reduce.mode}

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
        if self.lockstep is not None:
            self.lockstep.close()

