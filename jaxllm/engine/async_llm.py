"""AsyncLLM: the asyncio frontend (vLLM's AsyncLLM) over a multi-process engine core.

`generate()` is an async iterator of RequestOutputs. Every request gets a
`RequestOutputCollector`; one output-handler task reads EngineCoreOutputs from
the core, runs them through the OutputProcessor (which puts each RequestOutput
into its request's collector) and records stats. A consumer slower than the
engine does not queue up one object per token: pending deltas are merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from jaxllm.config import EngineArgs, EngineConfig, portable_config
from jaxllm.core.messages import EngineCoreOutputs, SchedulerStats
from jaxllm.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from jaxllm.engine.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestState,
)
from jaxllm.errors import EngineDeadError, ParameterError
from jaxllm.lora.request import LoRARequest
from jaxllm.metrics.loggers import FinishedRequestStats, StatLogger
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from jaxllm.engine.core_client import AsyncMPClient
    from jaxllm.engine.dp_client import DPAsyncMPClient

logger = logging.getLogger(__name__)

# Outputs processed between two yields to the event loop (keeps HTTP handlers responsive).
_OUTPUT_CHUNK = 256


class RequestOutputCollector:
    """Holds the next RequestOutput of one request; merges deltas a slow consumer missed."""

    def __init__(self, output_kind: RequestOutputKind):
        self.delta = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self.output, BaseException):
            pass  # a failed request stays failed
        elif self.output is None or isinstance(item, BaseException) or not self.delta:
            self.output = item
        else:
            _merge_delta(self.output, item)
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        item, self.output = self.output, None
        self.ready.clear()
        if isinstance(item, BaseException):
            self.output = item  # stays failed
            raise item
        return item


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for comp in new.outputs:
        old = by_index.get(comp.index)
        if old is None:
            into.outputs.append(comp)
            by_index[comp.index] = comp
            continue
        old.text += comp.text
        old.token_ids = old.token_ids + comp.token_ids
        if comp.logprobs is not None:
            old.logprobs = (old.logprobs or []) + comp.logprobs
        old.cumulative_logprob = comp.cumulative_logprob
        old.finish_reason, old.stop_reason = comp.finish_reason, comp.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


_LOAD = object()  # AsyncLLM(tokenizer=...) not given: load it from the model config


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None,
                 startup_timeout_s: float | None = None,
                 engine_core: AsyncMPClient | DPAsyncMPClient | None = None,
                 tokenizer: Any = _LOAD):
        from jaxllm.engine.dp_client import make_async_client

        self.config = config
        self.model_config = config.model_config
        self.tokenizer = (load_tokenizer(config.model_config) if tokenizer is _LOAD
                          else tokenizer)
        if engine_core is None:
            pc = config.parallel_config
            engine_core = make_async_client(config, pc.data_parallel_size,
                                            pc.tensor_parallel_size, startup_timeout_s)
        self.engine_core = engine_core
        self.input_processor = InputProcessor(config.model_config, self.tokenizer,
                                              self.engine_core.max_request_tokens, config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self.last_stats: SchedulerStats | None = None
        self.output_handler: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                         startup_timeout_s: float | None = None) -> AsyncLLM:
        """Spawns the engine core first: it starts JAX while this process builds the
        config (transformers' imports, the checkpoint's config), then receives it.

        With a config stored by an earlier start from the same inputs
        (`jaxllm/config_cache.py`) the core gets that one at once and loads the model
        meanwhile; should the config built here differ, the core is started again
        with it.
        """
        from jaxllm import config_cache
        from jaxllm.engine.dp_client import make_async_client

        def start(config: EngineConfig | Any) -> AsyncMPClient | DPAsyncMPClient:
            return make_async_client(config, args.data_parallel_size,
                                     args.tensor_parallel_size, startup_timeout_s)

        if args.data_parallel_size < 1:
            raise ParameterError("data_parallel_size",
                                 f"must be at least 1, got {args.data_parallel_size}")
        if args.distributed_spec() is not None:
            # A multi-host core joins the job before its JAX starts: it needs the config first.
            return cls(args.create_engine_config(), stat_loggers, startup_timeout_s)
        stored = config_cache.load(args)
        with ThreadPoolExecutor(1, thread_name_prefix="frontend-config") as pool:
            config_future = pool.submit(args.create_engine_config)
            tokenizer_future = pool.submit(
                lambda: load_tokenizer(config_future.result().model_config))
            client = start(config_future if stored is None else stored)
            try:
                config = config_future.result()
                tokenizer = tokenizer_future.result()
            except BaseException:
                client.shutdown()
                raise
        if stored is None:
            config_cache.store(args, config)
        elif not config_cache.same_config(stored, portable_config(config)):
            logger.warning("the stored engine config differs from the one built now; "
                           "starting the engine core again with the new one")
            client.shutdown()
            client = start(config)
            config_cache.store(args, config)
        try:
            return cls(config, stat_loggers, engine_core=client, tokenizer=tokenizer)
        except BaseException:
            client.shutdown()
            raise

    # ------------------------------------------------------------------ state

    @property
    def errored(self) -> bool:
        return self._dead is not None or self.engine_core.engine_dead \
            or not self.engine_core.is_alive()

    @property
    def dead_error(self) -> EngineDeadError:
        return self._dead or self.engine_core.dead_error()

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0,
                       arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs; leaving the iterator early aborts the request."""
        collector = self.add_request(request_id, prompt, sampling_params, priority,
                                     arrival_time, lora_request)
        finished = False
        try:
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort_now(request_id)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams, priority: int = 0,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> RequestOutputCollector:
        self.start()
        if self.errored:
            raise self.dead_error
        if request_id in self.output_processor.parents:
            raise ParameterError("request_id", f"{request_id!r} is already running")
        children, prompt_text, kind = self.input_processor.requests(
            request_id, prompt, params, arrival_time, priority, lora_request)
        collector = RequestOutputCollector(kind)
        parent = ParentRequest(request_id, len(children), kind, queue=collector)
        for i, req in enumerate(children):
            self.output_processor.add_request(req, prompt_text, parent, i)
        try:
            for req in children:
                self.engine_core.add_request(req)
        except BaseException:
            self.abort_now(request_id)
            raise
        return collector

    def abort_now(self, request_id: str | list[str]) -> None:
        """Drops the request here and tells the core to free its blocks."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = self.output_processor.abort_requests(ids)
        if core_ids and not self.errored:
            try:
                self.engine_core.abort_requests(core_ids)
            except EngineDeadError:
                pass
        if core_ids:
            logger.debug("aborted %s", ids)

    async def abort(self, request_id: str | list[str]) -> None:
        self.abort_now(request_id)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    # ------------------------------------------------------------------ output handling

    def start(self) -> None:
        """Starts the output handler (also done by the first request); needs a running loop."""
        if self.output_handler is None:
            self.output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="output-handler")

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                await self._process(outputs)
        except EngineDeadError as e:
            self._fail_all(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("output handler failed")
            self._fail_all(EngineDeadError(f"output handler failed: {e}"))

    async def _process(self, outputs: EngineCoreOutputs) -> None:
        items = outputs.all_outputs()
        for start in range(0, max(len(items), 1), _OUTPUT_CHUNK):
            chunk = EngineCoreOutputs(outputs=items[start:start + _OUTPUT_CHUNK])
            states = [s for o in chunk.outputs
                      if (s := self.output_processor.request_states.get(o.request_id))]
            had_first = [s.first_token_time is not None for s in states]
            last_times = [s.last_token_time for s in states]
            processed = self.output_processor.process_outputs(chunk)
            if processed.reqs_to_abort:
                self.engine_core.abort_requests(processed.reqs_to_abort)
            if self.stat_loggers:
                self._record_requests(states, had_first, last_times, outputs.engine_index)
            if start + _OUTPUT_CHUNK < len(items):
                await asyncio.sleep(0)
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
            for sl in self.stat_loggers:
                sl.record_scheduler(outputs.scheduler_stats, outputs.engine_index)

    def _record_requests(self, states: list[RequestState], had_first: list[bool],
                         last_times: list[float | None], engine: int) -> None:
        for state, had, last in zip(states, had_first, last_times, strict=True):
            if not had and state.first_token_time is not None:
                ttft = state.first_token_time - state.arrival_time
                for sl in self.stat_loggers:
                    sl.record_first_token(ttft, len(state.prompt_token_ids), engine)
            elif had and last is not None and state.last_token_time != last:
                for sl in self.stat_loggers:
                    sl.record_inter_token(state.last_token_time - last, engine)
            if state.finished:
                stats = FinishedRequestStats(
                    finish_reason=state.finish_reason or "abort",
                    e2e_latency=time.time() - state.arrival_time,
                    num_prompt_tokens=len(state.prompt_token_ids),
                    num_generation_tokens=len(state.token_ids),
                    decode_time=((state.last_token_time or 0.0) - state.first_token_time)
                    if state.first_token_time is not None else 0.0)
                for sl in self.stat_loggers:
                    sl.record_finished(stats, engine)

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        logger.error("engine dead, failing %d requests: %s",
                     len(self.output_processor.parents), error)
        for parent in list(self.output_processor.parents.values()):
            if parent.queue is not None:
                parent.queue.put(error)
        self.output_processor.abort_requests(list(self.output_processor.parents))

    # ------------------------------------------------------------------ lifecycle

    async def restart_engine_core(self, startup_timeout_s: float | None = None) -> None:
        """Replaces a dead engine core by a new process with the same config.

        Requests in flight were failed when the core died; the new core starts
        from the on-disk program cache. The event loop keeps serving meanwhile
        (health answers 503 until the new core is ready). Raises what the new
        core's start raised; the engine then stays dead.
        """
        from jaxllm.engine.dp_client import make_async_client

        if self.output_handler is not None and not self.output_handler.done():
            self.output_handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.output_handler
        self.output_handler = None
        if self.output_processor.parents:
            self._fail_all(self.dead_error)
        self.engine_core.shutdown()  # reaps the dead process, closes its sockets
        loop = asyncio.get_running_loop()
        pc = self.config.parallel_config
        client = await loop.run_in_executor(
            None, lambda: make_async_client(self.config, pc.data_parallel_size,
                                            pc.tensor_parallel_size, startup_timeout_s))
        self.engine_core = client
        self.input_processor.max_request_tokens = client.max_request_tokens
        self._dead = None
        self.start()

    def shutdown(self) -> None:
        if self.output_handler is not None and not self.output_handler.done():
            self.output_handler.cancel()
        closed = EngineDeadError("the server is shutting down")
        for parent in list(self.output_processor.parents.values()):
            if parent.queue is not None:
                parent.queue.put(closed)
        self.engine_core.shutdown()

