"""jaxllm: vLLM's v1 inference engine rebuilt on JAX/XLA."""

import time as _time

# When this process first imported jaxllm: start-up logs measure from here.
IMPORT_TIME = _time.time()

from jaxllm.config import EngineArgs  # noqa: E402 - after the clock above
from jaxllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput  # noqa: E402
from jaxllm.sampling_params import PoolingParams, RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "EngineArgs", "SamplingParams", "PoolingParams", "RequestOutput",
           "CompletionOutput", "PoolingRequestOutput", "RequestOutputKind", "__version__"]


def __getattr__(name: str):
    # Importing LLM pulls in JAX; keep `import jaxllm` light for the CLI and the server.
    if name == "LLM":
        from jaxllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
