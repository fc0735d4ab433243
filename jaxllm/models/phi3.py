"""Phi-3 and Phi-4 (`Phi3ForCausalLM`) on the generic decoder.

Llama's layer (SwiGLU, two RMSNorms, no biases, optional sliding window) with the
checkpoint's projections already fused: `self_attn.qkv_proj` stacks q, k and v
rows and `mlp.gate_up_proj` the gate then the up rows. They are split on the host
into the decoder's own fused layouts. Long-context variants rotate by LongRoPE
(`rope_type` "longrope", layers/rotary.py), Phi-4-mini part of each head only
(`partial_rotary_factor`).
"""

from __future__ import annotations

from typing import Any

from jaxllm.models.contract import WeightSource
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import DecoderArch, common_fields, swiglu_model_type
from jaxllm.models.decoder_weights import hf_weight_map, read_fused

MODEL_TYPES = ("phi3",)


def phi3_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A Phi-3 config as a `DecoderArch`."""
    swiglu_model_type(cfg, MODEL_TYPES, "Phi-3")
    return DecoderArch(**common_fields(cfg, tensor_parallel_size), qkv_bias=False,
                       o_bias=False, mlp_bias=False, qk_norm=False)


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 / Phi-4 causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(phi3_arch)

    @classmethod
    def hf_weight_map(cls, hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """The generic map with each layer's q/k/v and gate/up tensors read from the
        checkpoint's one fused tensor apiece."""
        arch = phi3_arch(hf_config, tensor_parallel_size)
        d = arch.head_dim
        kv_rows = arch.num_kv_heads // arch.kv_replicas * d
        return read_fused(hf_weight_map(arch), {
            "q_proj": ("qkv_proj", (arch.num_heads * d, kv_rows, kv_rows)),
            "gate_proj": ("gate_up_proj", (arch.intermediate_size,) * 2)})
