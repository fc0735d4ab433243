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

import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.models.contract import WeightSource
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import DecoderArch, common_fields, swiglu_model_type
from jaxllm.models.decoder_weights import hf_weight_map

MODEL_TYPES = ("phi3",)


def phi3_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A Phi-3 config as a `DecoderArch`."""
    swiglu_model_type(cfg, MODEL_TYPES, "Phi-3")
    return DecoderArch(**common_fields(cfg, tensor_parallel_size), qkv_bias=False,
                       o_bias=False, mlp_bias=False, qk_norm=False)


def _split_rows(sizes: tuple[int, ...], combine: Any) -> Any:
    """A combine that cuts one fused tensor into row blocks of `sizes`, then fuses them
    as the generic map's per-projection tensors would be."""
    cuts = np.cumsum(sizes)[:-1]

    def split(ts: list[np.ndarray]) -> np.ndarray:
        (fused,) = ts
        if fused.shape[0] != sum(sizes):
            raise ParameterError("model", f"fused tensor has {fused.shape[0]} rows; "
                                 f"config.json implies {sum(sizes)}")
        return combine(np.split(fused, cuts, axis=0))

    return split


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
        fused = {"q_proj": ("qkv_proj", (arch.num_heads * d, kv_rows, kv_rows)),
                 "gate_proj": ("gate_up_proj", (arch.intermediate_size,) * 2)}
        out = []
        for src in hf_weight_map(arch):
            prefix, _, first = src.tensors[0].rpartition(".")[0].rpartition(".")
            if first not in fused:
                out.append(src)
                continue
            name, sizes = fused[first]
            out.append(WeightSource(src.path, (f"{prefix}.{name}.weight",),
                                    _split_rows(sizes, src.combine)))
        return out
