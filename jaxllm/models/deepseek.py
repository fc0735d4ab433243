"""DeepSeek-V2 and DeepSeek-V3 on the generic decoder (`DeepseekV2ForCausalLM`,
`DeepseekV3ForCausalLM`: DeepSeek-V2/V2.5/V3/R1, Kimi-K2, Moonlight and their like).

Multi-head latent attention (models/mla.py) in every layer, two RMSNorms a layer, the
first `first_k_dense_replace` layers a dense SwiGLU MLP of `intermediate_size`, the rest
routed experts of `moe_intermediate_size` beside an ungated shared expert of
`n_shared_experts` experts' width (models/moe_weights.py: V3's grouped sigmoid routing
with its correction bias, GLM-4.5's; V2's softmax routing). The checkpoint's
multi-token-prediction layers (past `num_hidden_layers`) are not read.
"""

from __future__ import annotations

from typing import Any

from jaxllm.layers.rotary import rope_parameters, yarn_mscale
from jaxllm.models.decoder_arch import DecoderArch, layer_ropes, swiglu_model_type
from jaxllm.models.mla_arch import MLAArch
from jaxllm.models.moe import MoEForCausalLM
from jaxllm.models.moe_weights import DEEPSEEK_TYPES, MoEArch


def softmax_mscale(cfg: Any) -> float:
    """The softmax scale's factor under yarn with `mscale_all_dim`, `mscale(factor) ** 2`
    (1 otherwise), as transformers and DeepSeek compute it."""
    params = rope_parameters(cfg)
    m_all = params.get("mscale_all_dim")
    if params["rope_type"] == "default" or not m_all:
        return 1.0
    return yarn_mscale(float(params.get("factor") or 1.0), float(m_all)) ** 2


def deepseek_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A DeepSeek-V2 / V3 config as a `DecoderArch`: one kv head of the latent's width
    (copied on every shard under tensor parallelism), the query heads split over them."""
    model_type = swiglu_model_type(cfg, DEEPSEEK_TYPES, "DeepSeek")
    mla = MLAArch.from_hf_config(cfg, model_type)
    moe = MoEArch.split_over(cfg, tensor_parallel_size)
    heads, layers = int(cfg.num_attention_heads), int(cfg.num_hidden_layers)
    return DecoderArch(
        model_type=model_type, vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size), intermediate_size=int(cfg.intermediate_size),
        num_layers=layers, num_heads=heads, num_kv_heads=tensor_parallel_size,
        head_dim=mla.cache_dim, rms_norm_eps=float(cfg.rms_norm_eps),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=False, o_bias=mla.bias, mlp_bias=False, qk_norm=False,
        sliding_windows=(None,) * layers, ropes=layer_ropes(cfg, mla.rope_dim, None),
        kv_replicas=tensor_parallel_size,
        mlp_kinds=tuple("moe" if sparse else "dense" for sparse in moe.sparse_layers),
        moe=moe, mla=mla, attn_scale=mla.qk_dim ** -0.5 * softmax_mscale(cfg))


class DeepseekForCausalLM(MoEForCausalLM):
    """DeepSeek-V2 / V3 causal LM over a ragged, paged batch (its multi-token-prediction
    layers skipped as GLM-4.5's are)."""

    arch_from_hf_config = staticmethod(deepseek_arch)
