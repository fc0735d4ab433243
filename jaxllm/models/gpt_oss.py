"""GPT-OSS (`GptOssForCausalLM`, openai/gpt-oss-20b and -120b) on the generic decoder.

Attention with q/k/v and o biases, GQA, layers alternating a sliding window and
full attention (`layer_types`), yarn rope, and attention sinks: a learned logit per
query head that joins each softmax with no value (`attn_sinks`, models/decoder.py).
Every layer's MLP is routed experts (layers/moe.py) whose router and two products
add biases, routed by the renormalized softmax top-k and activated by the clamped
SwiGLU of layers/moe_glu.py; so they take the loop and the grouped matmul, never the
fused small-step kernels. models/moe_weights.py reads the stacked expert tensors,
float or MXFP4 (the released checkpoints, dequantized on load by models/mxfp4.py).
"""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import (
    DecoderArch,
    checked_model_type,
    common_fields,
    layer_types_of,
)
from jaxllm.models.moe_weights import MoEArch

MODEL_TYPES = ("gpt_oss",)
LAYER_TYPES = ("sliding_attention", "full_attention")


def gpt_oss_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A GPT-OSS config as a `DecoderArch`."""
    checked_model_type(cfg, MODEL_TYPES, "GPT-OSS")
    unknown = sorted(set(layer_types_of(cfg) or ()) - set(LAYER_TYPES))
    if unknown:
        raise ParameterError("config.json:layer_types", f"{unknown[0]!r} is not supported; "
                             f"supported: {', '.join(LAYER_TYPES)}")
    moe = MoEArch.split_over(cfg, tensor_parallel_size)
    bias = bool(getattr(cfg, "attention_bias", True))
    return DecoderArch(**common_fields(cfg, tensor_parallel_size), qkv_bias=bias, o_bias=bias,
                       mlp_bias=False, qk_norm=False, mlp_kinds=("moe",) * len(moe.sparse_layers),
                       moe=moe, attn_sinks=True)


class GptOssForCausalLM(DecoderForCausalLM):
    """GPT-OSS causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(gpt_oss_arch)
