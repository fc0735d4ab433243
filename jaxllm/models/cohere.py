"""Cohere's Command R (`CohereForCausalLM`) and Command R7B / Command A
(`Cohere2ForCausalLM`) on the generic decoder.

A parallel block (`DecoderArch.parallel_block`): each layer's one LayerNorm (mean-
centred, no bias) feeds the attention and the SwiGLU MLP side by side, and both add to
the residual together; the final norm is a LayerNorm too. Rope rotates interleaved
pairs (read as rotate-half by permuting the q and k rows, models/decoder_weights.py),
the embeddings are tied and the logits scaled by `logit_scale`. Cohere2 alternates
sliding-window layers with full ones (`layer_types`), and only its sliding layers
rotate: the full ones take no rope.
"""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import (
    PARALLEL_NORMS,
    DecoderArch,
    common_fields,
    layer_types_of,
    rope_on_sliding_layers_only,
    swiglu_model_type,
)

MODEL_TYPES = ("cohere", "cohere2")


def cohere_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A Cohere / Cohere2 config as a `DecoderArch`."""
    model_type = swiglu_model_type(cfg, MODEL_TYPES, "Cohere")
    if getattr(cfg, "use_qk_norm", False):  # per-head LayerNorm weights (Command R+)
        raise ParameterError("config.json:use_qk_norm", "Cohere's q/k LayerNorms are not "
                             "supported; supported: false")
    bias = bool(getattr(cfg, "attention_bias", False))
    fields = dict(common_fields(cfg, tensor_parallel_size),
                  rms_norm_eps=float(cfg.layer_norm_eps))  # its LayerNorms' epsilon
    arch = DecoderArch(**fields, qkv_bias=bias, o_bias=bias,
                       mlp_bias=False, qk_norm=False, rope_interleaved=True,
                       parallel_block=True, norm_names=PARALLEL_NORMS,
                       logits_scale=float(getattr(cfg, "logit_scale", None) or 1.0))
    types = layer_types_of(cfg)
    if model_type != "cohere2" or types is None:
        return arch
    return rope_on_sliding_layers_only(arch, types)


class CohereForCausalLM(DecoderForCausalLM):
    """Command R / R7B / A causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(cohere_arch)
