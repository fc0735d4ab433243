"""The mixture-of-experts families on the generic decoder: Mixtral, Qwen2/3-MoE, GLM-4.5
and OLMoE.

Llama-shaped attention (Qwen3-MoE with Qwen3's per-head q/k RMSNorm), two norms
per layer, and in place of the dense SwiGLU MLP the routed experts of
layers/moe.py in every sparse layer (models/moe_weights.py says which layers and
where their weights live); Qwen3-MoE's other layers keep a dense MLP of
`intermediate_size`; Qwen2-MoE's sparse layers add a gated shared expert
(layers/moe_shared.py). GLM-4.5: partial rotary, optional q/k norms, grouped sigmoid
routing and an ungated shared expert, its first layers dense, and the checkpoint's
multi-token-prediction layers (past `num_hidden_layers`) left unread. OLMoE: q and k
each normed over all their heads (as OLMo 2, models/olmo.py), then q, k and v clamped
to `clip_qkv` where the config sets it. Under tensor
parallelism the experts split over the devices.
"""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import DecoderArch, common_fields, swiglu_model_type
from jaxllm.models.moe_weights import MOE_MODEL_TYPES, MoEArch


def moe_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """A Mixtral / Qwen2-MoE / Qwen3-MoE / GLM-4.5 / OLMoE config as a `DecoderArch`."""
    model_type = swiglu_model_type(cfg, MOE_MODEL_TYPES, "mixture-of-experts")
    moe = MoEArch.split_over(cfg, tensor_parallel_size)
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    glm, olmoe = model_type == "glm4_moe", model_type == "olmoe"
    fields = common_fields(cfg, tensor_parallel_size)
    if olmoe and fields["num_heads"] * fields["head_dim"] != fields["hidden_size"]:
        raise ParameterError("config.json:head_dim", f"{fields['head_dim']} times "
                             f"num_attention_heads={fields['num_heads']} must be hidden_size="
                             f"{fields['hidden_size']} (OLMoE's q norm spans hidden_size)")
    clip = getattr(cfg, "clip_qkv", None) if olmoe else None
    if clip is not None and not float(clip) > 0:
        raise ParameterError("config.json:clip_qkv", f"must be positive, got {clip!r}")
    return DecoderArch(
        **fields,
        # Qwen2-MoE (`qkv_bias`) and GLM-4.5 (`attention_bias`): q/k/v biases, none on o.
        qkv_bias=bool(getattr(cfg, "qkv_bias", attention_bias)),
        o_bias=attention_bias and not glm,
        mlp_bias=False,
        qk_norm=model_type == "qwen3_moe" or (glm and bool(getattr(cfg, "use_qk_norm", False))),
        qk_norm_whole=olmoe, clip_qkv=None if clip is None else float(clip),
        mlp_kinds=tuple("moe" if sparse else "dense" for sparse in moe.sparse_layers),
        moe=moe,
    )


class MoEForCausalLM(DecoderForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE / GLM-4.5 / OLMoE causal LM over a ragged, paged
    batch."""

    arch_from_hf_config = staticmethod(moe_arch)

    @classmethod
    def hf_ignored_tensor(cls, hf_config: Any, name: str) -> bool:
        """Also GLM-4.5's multi-token-prediction layers, which speculation would read."""
        layers, extra = int(hf_config.num_hidden_layers), int(
            getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
        mtp = tuple(f"model.layers.{i}." for i in range(layers, layers + extra))
        return (extra > 0 and name.startswith(mtp)) or super().hf_ignored_tensor(hf_config, name)
