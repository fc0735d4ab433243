"""Hugging Face architecture name -> the Flax NNX class that implements it.

A model class takes `(hf_config, *, dtype, rngs, attn_backend, swiglu)` (swiglu: the
MLP up-projection of jaxllm/layers/mlp.py, None for XLA's), is called as
`model(input_ids, positions, kv_cache, md) -> (hidden, kv_cache)` (one cache
array for all layers, see jaxllm/layers/attention.py), has
`compute_logits(hidden)`, and tells the loader where its weights live in a
checkpoint (`hf_weight_map`, `hf_ignored_tensor`).
"""

from __future__ import annotations

from jaxllm.errors import ParameterError
from jaxllm.models.llama import LlamaForCausalLM

_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
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
