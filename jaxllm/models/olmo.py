"""AI2's OLMo 2 and OLMo 3 (`Olmo2ForCausalLM`, `Olmo3ForCausalLM`) on the generic decoder.

Llama's projections and SwiGLU MLP with two differences in where the norms sit:
no norm on a layer's input, the two RMSNorms on the attention's and the MLP's
outputs before each residual add (`DecoderArch.post_norms`), and q and k normed
right after their projections, each over all of its heads at once rather than per
head (`qk_norm_whole`, models/decoder.py's `whole_qk_norm`), before rope. OLMo 3
adds sliding-window layers (three of every four by default, per `layer_types`) and
rope parameters per layer type, both read as for every family.
"""

from __future__ import annotations

from typing import Any

from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import POST_NORMS, DecoderArch, common_fields, swiglu_model_type

MODEL_TYPES = ("olmo2", "olmo3")


def olmo_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """An OLMo 2 / OLMo 3 config as a `DecoderArch`."""
    swiglu_model_type(cfg, MODEL_TYPES, "OLMo 2/3")
    bias = bool(getattr(cfg, "attention_bias", False))  # q, k, v and o alike
    return DecoderArch(**common_fields(cfg, tensor_parallel_size), qkv_bias=bias, o_bias=bias,
                       mlp_bias=False, qk_norm=False, qk_norm_whole=True, post_norms=True,
                       norm_names=POST_NORMS)


class OlmoForCausalLM(DecoderForCausalLM):
    """OLMo 2 / OLMo 3 causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(olmo_arch)
