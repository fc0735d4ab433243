"""IBM Granite 3.x models on the generic decoder: dense (`GraniteForCausalLM`) and
mixture-of-experts (`GraniteMoeForCausalLM`, `GraniteMoeSharedForCausalLM`, whose routed
experts and shared expert models/moe_weights.py reads).

Llama's layer with four scalar multipliers: the embeddings times
`embedding_multiplier`, each attention and MLP output times `residual_multiplier`
before its residual add, the attention scale `attention_multiplier` (not
`head_dim ** -0.5`), and the final logits divided by `logits_scaling`. The two
linear ones are folded into the weights as they load: `residual_multiplier` into
o_proj and every down projection (the experts' and the shared expert's too, and the
biases), `embedding_multiplier` into the embedding
matrix, whose use as the tied logits head the logits' scale then takes back out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxllm.models.contract import WeightSource
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import DecoderArch, common_fields, swiglu_model_type
from jaxllm.models.decoder_weights import hf_weight_map
from jaxllm.models.moe_weights import GRANITE_MOE_TYPES, MoEArch

MODEL_TYPES = ("granite", *GRANITE_MOE_TYPES)


def granite_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A Granite config as a `DecoderArch`."""
    model_type = swiglu_model_type(cfg, MODEL_TYPES, "Granite")
    fields = common_fields(cfg, tensor_parallel_size)
    moe = None if model_type == "granite" else MoEArch.split_over(cfg, tensor_parallel_size)
    experts = {} if moe is None else dict(moe=moe, mlp_kinds=("moe",) * len(moe.sparse_layers))
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    embed = float(getattr(cfg, "embedding_multiplier", 1.0))
    scale = 1.0 / float(getattr(cfg, "logits_scaling", 1.0))
    if fields["tie_word_embeddings"]:
        scale /= embed  # the head is the embedding matrix, which carries the multiplier
    return DecoderArch(
        **fields, qkv_bias=attention_bias, o_bias=attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)), qk_norm=False,
        query_pre_attn_scalar=float(getattr(cfg, "attention_multiplier", 1.0)) ** -2,
        logits_scale=scale, residual_scale=float(getattr(cfg, "residual_multiplier", 1.0)),
        **experts)


def _scaled(src: WeightSource, factor: float) -> WeightSource:
    """`src` times `factor`. A quantized checkpoint's values pass unchanged: the loader
    combines their scales through the same function, and those take the factor."""
    def combine(ts: list[np.ndarray]) -> np.ndarray:
        out = src.combine(ts)
        if out.dtype.itemsize == 1:  # int8 / float8 values
            return out
        return (out.astype(np.float32) * np.float32(factor)).astype(out.dtype)

    return dataclasses.replace(src, combine=combine)


class GraniteForCausalLM(DecoderForCausalLM):
    """Granite 3.x causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(granite_arch)

    @classmethod
    def hf_weight_map(cls, hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """The generic map with the embedding and residual multipliers folded in."""
        arch = granite_arch(hf_config, tensor_parallel_size)
        embed = float(getattr(hf_config, "embedding_multiplier", 1.0))
        out = []
        for src in hf_weight_map(arch):
            if src.path == ("embed_tokens",):
                src = _scaled(src, embed)
            elif "o_proj" in src.path or "down_proj" in src.path:
                src = _scaled(src, arch.residual_scale)
            out.append(src)
        return out
