"""Gemma, Gemma 2 and Gemma 3 (text) on the generic decoder.

All: GeGLU MLPs (tanh-approximated GELU), RMSNorm scaling by `1 + weight`,
embeddings times sqrt(hidden) in the model dtype, tied embeddings. Gemma (1) has
Llama's two norms per layer and nothing more. Gemma 2 and 3: four norms per layer
(input, post-attention, pre- and post-feedforward), the attention scale
`query_pre_attn_scalar ** -0.5`, and sliding-window layers alternating with global
ones (`layer_types`). Gemma 2 soft-caps the attention
logits and the final logits; Gemma 3 norms each head's q and k and gives its
local layers their own rope base (`rope_parameters` per layer type, which
transformers builds from `rope_local_base_freq` and `rope_scaling`).
"""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.layers.gated_mlp import activation_name
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import (
    PRE_NORMS,
    SANDWICH_NORMS,
    DecoderArch,
    checked_model_type,
    common_fields,
)

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")


def gemma_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A Gemma / Gemma 2 / Gemma 3 text config as a `DecoderArch`."""
    model_type = checked_model_type(cfg, MODEL_TYPES, "Gemma text")
    act = (getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
           or "gelu_pytorch_tanh")
    activation = activation_name(act, "config.json:hidden_activation")
    if activation != "gelu_tanh":
        raise ParameterError("config.json:hidden_activation",
                             f"{act!r} is not supported; supported: 'gelu_pytorch_tanh'")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ParameterError("config.json:use_bidirectional_attention",
                             "bidirectional attention is not supported (causal LM only)")
    attention_bias = bool(getattr(cfg, "attention_bias", False))

    def cap(name: str) -> float | None:
        value = getattr(cfg, name, None)
        return float(value) if value else None

    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    return DecoderArch(
        **common_fields(cfg, tensor_parallel_size),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=False,
        qk_norm=model_type == "gemma3_text",
        activation=activation,
        norm_names=PRE_NORMS if model_type == "gemma" else SANDWICH_NORMS,
        norm_offset=True,
        embed_scale=True,
        attn_soft_cap=cap("attn_logit_softcapping"),
        final_soft_cap=cap("final_logit_softcapping"),
        query_pre_attn_scalar=float(scalar) if scalar else None,
    )


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma / Gemma 2 / Gemma 3 text causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(gemma_arch)
