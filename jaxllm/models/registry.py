"""Hugging Face architecture name -> the Flax NNX class that implements it.

Every class implements the model contract (models/contract.py); today all are
configurations of the generic decoder (models/decoder.py).
"""

from __future__ import annotations

from jaxllm.errors import ParameterError
from jaxllm.models.gemma import GemmaForCausalLM
from jaxllm.models.llama import LlamaForCausalLM

_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    """The model class for an HF `architectures[0]` name."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ParameterError(
            "model", f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}") from None
