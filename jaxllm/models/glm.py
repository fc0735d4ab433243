"""GLM-4 dense models on the generic decoder: `GlmForCausalLM` (GLM-4-9B) and
`Glm4ForCausalLM` (GLM-4-0414, GLM-Z1).

Both rotate interleaved pairs over the first `partial_rotary_factor` of each head
(read as rotate-half by permuting the q and k rows as they load,
models/decoder_weights.py `rope_order`), carry q/k/v biases (`attention_bias`), no
output bias, and store gate and up fused in one `mlp.gate_up_proj` tensor. GLM-4-0414
adds norms on the attention's and the MLP's outputs before their residual adds (the
decoder's four-norm layer, as Gemma's, with plain RMSNorm weights).
"""

from __future__ import annotations

from typing import Any

from jaxllm.models.contract import WeightSource
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import PRE_NORMS, DecoderArch, common_fields, swiglu_model_type
from jaxllm.models.decoder_weights import hf_weight_map, read_fused

MODEL_TYPES = ("glm", "glm4")
# GLM-4-0414's norms in the decoder's four-norm order: before attention, after it,
# before the MLP, after it.
GLM4_NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
              "post_mlp_layernorm")


def glm_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A GLM / GLM-4 config as a `DecoderArch`."""
    model_type = swiglu_model_type(cfg, MODEL_TYPES, "GLM-4 dense")
    return DecoderArch(
        **common_fields(cfg, tensor_parallel_size),
        qkv_bias=bool(getattr(cfg, "attention_bias", False)), o_bias=False, mlp_bias=False,
        qk_norm=False, norm_names=GLM4_NORMS if model_type == "glm4" else PRE_NORMS,
        rope_interleaved=True)


class GlmForCausalLM(DecoderForCausalLM):
    """GLM-4 / GLM-4-0414 causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(glm_arch)

    @classmethod
    def hf_weight_map(cls, hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """The generic map with gate and up read from the checkpoint's fused tensor."""
        arch = glm_arch(hf_config, tensor_parallel_size)
        return read_fused(hf_weight_map(arch), {
            "gate_proj": ("gate_up_proj", (arch.intermediate_size,) * 2)})
