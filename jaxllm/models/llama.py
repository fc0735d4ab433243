"""The Llama family on the generic decoder: Llama 2/3/3.1, Mistral, Ministral (and
Ministral 3), Qwen2/3, SmolLM3, Seed-OSS and ERNIE 4.5 (dense).

The Hugging Face architectures differ only in q/k/v (and o) bias, per-head q/k
RMSNorm (Qwen3), the output projection's bias (Seed-OSS's `attention_out_bias`), the
rope parameters and layout (ERNIE 4.5 rotates interleaved pairs), layers without rope
(SmolLM3's `no_rope_layers`, models/decoder_arch.py), the sliding window (Mistral;
Ministral and Qwen2/3 per `layer_types`) and Ministral 3's query scale growing with
the position past its original context (`DecoderArch.q_position_scale`); all run
SwiGLU MLPs and two norms per layer. The weights' layouts and shardings are
models/decoder.py's.
"""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import DecoderArch, common_fields, swiglu_model_type

MODEL_TYPES = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "smollm3",
               "seed_oss", "ernie4_5", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
# The Qwen-VL language models (models/multimodal.py) are their text families' layers.
_AS_TEXT_FAMILY = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}


def llama_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A Llama-family config as a `DecoderArch`."""
    model_type = swiglu_model_type(cfg, MODEL_TYPES, "Llama-family", default="llama")
    model_type = _AS_TEXT_FAMILY.get(model_type, model_type)
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    if model_type == "ernie4_5":  # one `use_bias` for every projection; interleaved rope
        bias = bool(getattr(cfg, "use_bias", False))
        return DecoderArch(**common_fields(cfg, tensor_parallel_size), qkv_bias=bias,
                           o_bias=bias, mlp_bias=bias, qk_norm=False, rope_interleaved=True)
    return DecoderArch(
        **common_fields(cfg, tensor_parallel_size),
        qkv_bias=model_type == "qwen2" or attention_bias,
        # Seed-OSS names the output projection's bias on its own.
        o_bias=(bool(getattr(cfg, "attention_out_bias", False)) if model_type == "seed_oss"
                else model_type != "qwen2" and attention_bias),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        q_position_scale=_ministral3_q_scale(cfg) if model_type == "ministral3" else None,
    )


def _ministral3_q_scale(cfg: Any) -> tuple[float, int] | None:
    """Ministral 3's query scale (`rope_parameters`' `llama_4_scaling_beta` over its
    `original_max_position_embeddings`); None without a beta."""
    params = getattr(cfg, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return None
    length = params.get("original_max_position_embeddings")
    if not isinstance(length, int) or length < 1:
        raise ParameterError("config.json:rope_parameters.original_max_position_embeddings",
                             f"must be a positive integer with llama_4_scaling_beta, got "
                             f"{length!r}")
    return float(beta), length


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / Seed-OSS / ERNIE 4.5 causal LM over a
    ragged, paged batch."""

    arch_from_hf_config = staticmethod(llama_arch)
