"""The mixture-of-experts families' static shape (`MoEArch`, read once from a Hugging Face
config) and where each sparse layer's weights live in a Hugging Face checkpoint.

Mixtral (`MixtralForCausalLM`): every layer sparse, the experts under
`block_sparse_moe` named `w1` (gate), `w3` (up), `w2` (down), the top-k weights
always renormalized. Qwen3-MoE (`Qwen3MoeForCausalLM`): a layer is sparse unless it
is listed in `mlp_only_layers` or `(layer + 1) % decoder_sparse_step != 0` (those
keep a dense MLP of `intermediate_size`), the experts under `mlp` named
`gate_proj` / `up_proj` / `down_proj` with `moe_intermediate_size`, renormalized iff
`norm_topk_prob`. Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen3-MoE's layout and layer
rule, plus in each sparse layer a shared expert (`mlp.shared_expert.*`, of
`shared_expert_intermediate_size`) gated by `mlp.shared_expert_gate`. GLM-4.5
(`Glm4MoeForCausalLM`): sparse from layer `first_k_dense_replace` on, routed by grouped
sigmoid scores with `mlp.gate.e_score_correction_bias` (layers/moe_routing.py), and an
ungated shared expert `mlp.shared_experts` of `n_shared_experts` experts' width. All are the
hub's per-expert layout, the one real checkpoints use and the one transformers'
`save_pretrained` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.layers.moe_routing import GroupedRouting
from jaxllm.models.contract import WeightSource

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe")


@dataclass(frozen=True)
class MoEArch:
    """The experts' shape and which layers have them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (else the dense MLP)
    block: str  # the checkpoint's module holding router and experts, under model.layers.N
    names: tuple[str, str, str]  # one expert's gate, up and down projections
    shared_intermediate_size: int = 0  # the shared expert's (0: none)
    shared_gate: bool = False  # the shared expert's output scaled by a sigmoid gate
    shared_name: str = "shared_expert"  # its module under `block`
    grouped: GroupedRouting | None = None  # grouped sigmoid routing (else softmax top-k)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> MoEArch | None:
        """None for a dense model type."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in MOE_MODEL_TYPES:
            return None
        layers = int(cfg.num_hidden_layers)
        experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        if experts < 1:
            raise ParameterError("config.json:num_experts", f"must be at least 1, got {experts}")
        if model_type == "mixtral":
            return cls(num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                       intermediate_size=int(cfg.intermediate_size), renormalize=True,
                       sparse_layers=(True,) * layers, block="block_sparse_moe",
                       names=("w1", "w3", "w2"))
        if model_type == "glm4_moe":
            routing = GroupedRouting(
                top_k=int(cfg.num_experts_per_tok), renormalize=bool(cfg.norm_topk_prob),
                groups=int(cfg.n_group or 1), topk_groups=int(cfg.topk_group or 1),
                scale=float(cfg.routed_scaling_factor))
            routing.check(experts)
            first_sparse = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
            return cls(num_experts=experts, top_k=routing.top_k,
                       intermediate_size=int(cfg.moe_intermediate_size),
                       renormalize=routing.renormalize,
                       sparse_layers=tuple(i >= first_sparse for i in range(layers)),
                       block="mlp", names=("gate_proj", "up_proj", "down_proj"),
                       shared_intermediate_size=int(cfg.moe_intermediate_size)
                       * int(getattr(cfg, "n_shared_experts", 0) or 0),
                       shared_name="shared_experts", grouped=routing)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in (getattr(cfg, "mlp_only_layers", None) or ())}
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        return cls(num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                   intermediate_size=int(cfg.moe_intermediate_size),
                   renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                   sparse_layers=tuple(i not in dense and (i + 1) % step == 0
                                       for i in range(layers)),
                   block="mlp", names=("gate_proj", "up_proj", "down_proj"),
                   shared_intermediate_size=shared if model_type == "qwen2_moe" else 0,
                   shared_gate=model_type == "qwen2_moe" and shared > 0)


def _only(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0]


def moe_weights(arch: Any, hf_prefix: str, path: tuple[str | int, ...]) -> list[WeightSource]:
    """Router, stacked gate/up `[E, 2, I, H]` and stacked down `[E, H, I]` of the sparse
    layer at `path` (`("layers", i, "mlp")`), each from the per-expert tensors.
    `arch` is the `DecoderArch` (its `moe`); `hf_prefix` names the dense MLP's module,
    which Mixtral's experts do not live under."""
    moe: MoEArch = arch.moe
    pre = f"model.layers.{path[1]}.{moe.block}."
    gate, up, down = moe.names
    experts = range(moe.num_experts)

    def gate_up(ts: list[np.ndarray]) -> np.ndarray:  # gate_0, up_0, gate_1, up_1, ...
        stacked = np.stack(ts, axis=0)
        return stacked.reshape(moe.num_experts, 2, *stacked.shape[1:])

    def stack(ts: list[np.ndarray]) -> np.ndarray:
        return np.stack(ts, axis=0)

    out = []
    if moe.shared_gate:  # the shared expert itself: decoder_weights' gated MLP
        out.append(WeightSource(path + ("shared_expert_gate",),
                                (pre + "shared_expert_gate.weight",), _only))
    if moe.grouped is not None:
        out.append(WeightSource(path + ("e_score_correction_bias",),
                                (pre + "gate.e_score_correction_bias",), _only))
    return out + [
        WeightSource(path + ("router",), (pre + "gate.weight",), _only),
        WeightSource(path + ("gate_up_proj",), tuple(
            f"{pre}experts.{e}.{n}.weight" for e in experts for n in (gate, up)), gate_up),
        WeightSource(path + ("down_proj",), tuple(
            f"{pre}experts.{e}.{down}.weight" for e in experts), stack),
    ]
