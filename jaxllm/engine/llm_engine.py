"""LLMEngine: the synchronous frontend (vLLM's LLMEngine) over an EngineCoreClient."""

from __future__ import annotations

import logging
from typing import Any

from jaxllm.config import EngineArgs, EngineConfig
from jaxllm.core.messages import SchedulerStats
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.dp_client import DPSyncMPClient
from jaxllm.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from jaxllm.engine.output_processor import OutputProcessor, ParentRequest
from jaxllm.errors import ParameterError
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.sampling_params import (
    PoolingParams,
    SamplingParams,
)

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess: bool = False):
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = load_tokenizer(config.model_config)
        if config.parallel_config.data_parallel_size > 1:
            # Each replica is its own core process (dp_client.py).
            self.engine_core: EngineCoreClient = DPSyncMPClient(config)
        else:
            # A multi-host core runs in its own process: when a follower host dies it
            # exits (engine/lockstep.py), and this process reports the engine dead.
            self.engine_core = EngineCoreClient.make_client(
                config, multiprocess or config.parallel_config.distributed is not None)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer,
                                              self.engine_core.max_request_tokens, config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_stats: SchedulerStats | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = False) -> LLMEngine:
        return cls(args.create_engine_config(), multiprocess)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        if request_id in self.output_processor.parents:
            raise ParameterError("request_id", f"{request_id!r} is already running")
        children, prompt_text, kind = self.input_processor.requests(
            request_id, prompt, params, arrival_time, priority, lora_request)
        parent = ParentRequest(request_id, len(children), kind)
        for i, req in enumerate(children):
            self.output_processor.add_request(req, prompt_text, parent, i)
            self.engine_core.add_request(req)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        outputs = self.engine_core.get_output()
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
        processed = self.output_processor.process_outputs(outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        self.engine_core.shutdown()
