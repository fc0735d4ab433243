"""jaxllm: vLLM's v1 inference engine rebuilt on JAX/XLA."""

import os as _os

from jaxllm.import_clock import IMPORT_TIME

# The KV cache takes hbm_utilization of the device's whole memory, as vLLM's
# gpu_memory_utilization does; JAX's GPU allocator would otherwise cap this
# process at 75% of it. Set before JAX starts its backend (a value already set wins).
_os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from jaxllm.xla_flags import add_gpu_xla_flags  # noqa: E402 - after the clock above

add_gpu_xla_flags()  # also before the backend starts

from jaxllm.config import EngineArgs  # noqa: E402 - after the clock above
from jaxllm.outputs import (  # noqa: E402
    ClassificationRequestOutput,
    CompletionOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from jaxllm.sampling_params import PoolingParams, RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["IMPORT_TIME", "LLM", "EngineArgs", "SamplingParams", "PoolingParams", "RequestOutput",
           "CompletionOutput", "PoolingRequestOutput", "ScoringRequestOutput",
           "ClassificationRequestOutput", "RequestOutputKind", "__version__"]


def __getattr__(name: str):
    # Importing LLM pulls in JAX; keep `import jaxllm` light for the CLI and the server.
    if name == "LLM":
        from jaxllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
