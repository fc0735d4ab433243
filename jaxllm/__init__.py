"""jaxllm: vLLM's v1 inference engine rebuilt on JAX/XLA."""

from jaxllm.config import EngineArgs
from jaxllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from jaxllm.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "EngineArgs", "SamplingParams", "PoolingParams", "RequestOutput",
           "CompletionOutput", "PoolingRequestOutput", "RequestOutputKind", "__version__"]


def __getattr__(name: str):
    # Importing LLM pulls in JAX; keep `import jaxllm` light for the CLI and the server.
    if name == "LLM":
        from jaxllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
