"""How the frontend talks to the engine core.

`EngineCoreClient` is the interface; `InprocClient` runs the core in this
process (tests, simple offline use). The multi-process clients (ZMQ) live in
`core_mp.py` and implement the same methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from jaxllm.config import EngineConfig
from jaxllm.engine.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    max_request_tokens: int

    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool = False) -> EngineCoreClient:
        if multiprocess:
            from jaxllm.engine.core_mp import SyncMPClient

            return SyncMPClient(config)
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        pass


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig):
        from jaxllm.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self.max_request_tokens = self.engine_core.max_request_tokens
        self._rejected: deque = deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        err = self.engine_core.add_request(request)
        if err is not None:
            self._rejected.append(err)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.engine_core.step()
        while self._rejected:
            outputs.outputs.append(self._rejected.popleft())
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
