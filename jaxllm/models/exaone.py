"""LG AI Research's EXAONE 4.0 (`Exaone4ForCausalLM`) on the generic decoder.

OLMo 2's norm placement (models/olmo.py: no norm on a layer's input, RMSNorms on
the attention's and the MLP's outputs) with Qwen3's per-head q/k RMSNorm, no biases,
and a hybrid attention layout: with `sliding_window` set, the `sliding_attention`
layers (three of every four by default) attend within the window with rope, and the
`full_attention` layers attend globally with no rope at all (NoPE). Without a window
every layer is global and rotated.
"""

from __future__ import annotations

from typing import Any

from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import (
    POST_NORMS,
    DecoderArch,
    common_fields,
    layer_types_of,
    rope_on_sliding_layers_only,
    swiglu_model_type,
)

MODEL_TYPES = ("exaone4",)


def exaone4_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """An EXAONE 4.0 config as a `DecoderArch`."""
    swiglu_model_type(cfg, MODEL_TYPES, "EXAONE 4.0")
    arch = DecoderArch(**common_fields(cfg, tensor_parallel_size), qkv_bias=False, o_bias=False,
                       mlp_bias=False, qk_norm=True, post_norms=True, norm_names=POST_NORMS)
    if getattr(cfg, "sliding_window", None) is None:
        return arch
    # Hybrid: the global layers rotate nothing.
    return rope_on_sliding_layers_only(
        arch, layer_types_of(cfg) or ("full_attention",) * arch.num_layers)


class Exaone4ForCausalLM(DecoderForCausalLM):
    """EXAONE 4.0 causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(exaone4_arch)
