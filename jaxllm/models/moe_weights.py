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
ungated shared expert `mlp.shared_experts` of `n_shared_experts` experts' width. OLMoE
(`OlmoeForCausalLM`): Qwen3-MoE's names, every layer sparse, the experts of
`intermediate_size`, renormalized iff `norm_topk_prob`. All are the hub's per-expert
layout, the one real checkpoints use and the one transformers' `save_pretrained` writes.
DeepSeek-V2/V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): GLM-4.5's layout and
shared experts, sparse from `first_k_dense_replace` on (every `moe_layer_freq`-th layer);
V3 routes as GLM-4.5, V2 by softmax scores (greedy, or the best `topk_group` of
`n_group` groups by their best score), without a correction bias.
GPT-OSS (`GptOssForCausalLM`): every layer sparse, the router
`mlp.router` with a bias, its top-k logits softmaxed (the renormalized softmax top-k),
and every expert in one stacked tensor per projection, biases beside them:
`mlp.experts.gate_up_proj [E, H, 2I]` (`[in, out]`, gate and up columns interleaved:
gate `[..., ::2]`, up `[..., 1::2]`) with `gate_up_proj_bias [E, 2I]`, and `down_proj
[E, I, H]` with `down_proj_bias [E, H]`, as `save_pretrained` writes them; the released
checkpoints store the two weights as MXFP4 `*_blocks` / `*_scales` in the `[out, in]`
orientation (models/mxfp4.py), dequantized on load. Granite MoE (`GraniteMoeForCausalLM`,
`GraniteMoeSharedForCausalLM`): every layer sparse, the router `block_sparse_moe.router.layer`,
its top-k logits softmaxed, every expert in one tensor per projection, `[out, in]`:
`block_sparse_moe.input_linear [E, 2I, H]` (gate rows, then up rows) and `output_linear [E,
H, I]`; GraniteMoeShared adds an ungated shared expert `shared_mlp` of
`shared_intermediate_size`, its `input_linear [2S, H]` fused the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxllm.distributed.mesh import MLA_MODEL_TYPES
from jaxllm.errors import ParameterError
from jaxllm.layers.moe_glu import SWIGLU, ExpertGLU
from jaxllm.layers.moe_routing import GroupedRouting
from jaxllm.models import mxfp4
from jaxllm.models.contract import WeightSource

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe", "olmoe")
DEEPSEEK_TYPES = MLA_MODEL_TYPES  # models/deepseek.py reads them
GRANITE_MOE_TYPES = ("granitemoe", "granitemoeshared")  # models/granite.py reads them


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
    granite: bool = False  # Granite's fused tensors (input_linear, output_linear), above
    grouped: GroupedRouting | None = None  # grouped sigmoid routing (else softmax top-k)
    biases: bool = False  # the router and both expert products add biases (GPT-OSS)
    glu: ExpertGLU = SWIGLU  # the experts' activation (layers/moe_glu.py)
    stacked: bool = False  # one tensor per projection for every expert (GPT-OSS's layout)
    mxfp4: bool = False  # those stacked weights as MXFP4 blocks and scales

    @classmethod
    def split_over(cls, cfg: Any, tensor_parallel_size: int) -> MoEArch:
        """`from_hf_config` of a mixture-of-experts config, its experts checked to split
        whole over `tensor_parallel_size` devices (expert parallel)."""
        moe = cls.from_hf_config(cfg)
        if tensor_parallel_size > 1 and moe.num_experts % tensor_parallel_size:
            raise ParameterError("tensor_parallel_size",
                                 f"{tensor_parallel_size} does not divide the "
                                 f"{moe.num_experts} experts (each device holds whole experts)")
        return moe

    @classmethod
    def from_hf_config(cls, cfg: Any) -> MoEArch | None:
        """None for a dense model type."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in (*MOE_MODEL_TYPES, "gpt_oss", *GRANITE_MOE_TYPES, *DEEPSEEK_TYPES):
            return None
        layers = int(cfg.num_hidden_layers)
        experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        if experts < 1:
            raise ParameterError("config.json:num_experts", f"must be at least 1, got {experts}")
        if model_type == "gpt_oss":
            return cls(num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                       intermediate_size=int(cfg.intermediate_size), renormalize=True,
                       sparse_layers=(True,) * layers, block="mlp",
                       names=("gate_up_proj", "gate_up_proj", "down_proj"), biases=True,
                       glu=_gpt_oss_glu(cfg), stacked=True, mxfp4=mxfp4.is_mxfp4(cfg))
        if model_type in GRANITE_MOE_TYPES:
            return cls(num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                       intermediate_size=int(cfg.intermediate_size), renormalize=True,
                       sparse_layers=(True,) * layers, block="block_sparse_moe",
                       names=("input_linear", "input_linear", "output_linear"),
                       shared_intermediate_size=int(
                           getattr(cfg, "shared_intermediate_size", 0) or 0),
                       shared_name="shared_mlp", granite=True)
        if model_type == "olmoe":  # every layer sparse, the experts `intermediate_size` wide
            return cls(num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                       intermediate_size=int(cfg.intermediate_size),
                       renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                       sparse_layers=(True,) * layers, block="mlp",
                       names=("gate_proj", "up_proj", "down_proj"))
        if model_type == "mixtral":
            return cls(num_experts=experts, top_k=int(cfg.num_experts_per_tok),
                       intermediate_size=int(cfg.intermediate_size), renormalize=True,
                       sparse_layers=(True,) * layers, block="block_sparse_moe",
                       names=("w1", "w3", "w2"))
        if model_type in ("glm4_moe", *DEEPSEEK_TYPES):
            routing = _grouped_routing(cfg, model_type)
            routing.check(experts)
            first_sparse = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
            # DeepSeek's `moe_layer_freq` (as vLLM reads it; 1 in every released config).
            every = int(getattr(cfg, "moe_layer_freq", None) or 1)
            return cls(num_experts=experts, top_k=routing.top_k,
                       intermediate_size=int(cfg.moe_intermediate_size),
                       renormalize=routing.renormalize,
                       sparse_layers=tuple(i >= first_sparse and i % every == 0
                                           for i in range(layers)),
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


def _grouped_routing(cfg: Any, model_type: str) -> GroupedRouting:
    """GLM-4.5's and DeepSeek-V3's grouped sigmoid routing (`topk_method` "noaux_tc"), or
    DeepSeek-V2's softmax routing ("greedy", or "group_limited_greedy" over `n_group`
    groups). Renormalized iff `norm_topk_prob` (as vLLM reads DeepSeek-V2's too), then
    times `routed_scaling_factor`."""
    v2 = model_type == "deepseek_v2"
    method = getattr(cfg, "topk_method", None) or ("greedy" if v2 else "noaux_tc")
    allowed = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    if method not in allowed:
        raise ParameterError("config.json:topk_method", f"{method!r} is not supported for "
                             f"{model_type}; supported: {', '.join(allowed)}")
    grouped = method != "greedy"
    return GroupedRouting(
        top_k=int(cfg.num_experts_per_tok), renormalize=bool(getattr(cfg, "norm_topk_prob",
                                                                     False)),
        groups=int(getattr(cfg, "n_group", None) or 1) if grouped else 1,
        topk_groups=int(getattr(cfg, "topk_group", None) or 1) if grouped else 1,
        scale=float(getattr(cfg, "routed_scaling_factor", None) or 1.0), softmax=v2)


def _gpt_oss_glu(cfg: Any) -> ExpertGLU:
    """GPT-OSS's clamped activation, `swiglu_alpha` and `swiglu_limit` from the config
    (transformers' defaults where absent)."""
    fields = {"swiglu_alpha": getattr(cfg, "swiglu_alpha", 1.702),
              "swiglu_limit": getattr(cfg, "swiglu_limit", 7.0)}
    for field, value in fields.items():
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value <= 0):
            raise ParameterError(f"config.json:{field}", f"must be a positive number, "
                                 f"got {value!r}")
    return ExpertGLU(alpha=float(fields["swiglu_alpha"]), limit=float(fields["swiglu_limit"]),
                     up_offset=1.0)


def _only(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0]


def _shaped(t: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    if tuple(t.shape) != shape:
        raise ParameterError("model", f"tensor {name!r} has shape {tuple(t.shape)}, but "
                             f"config.json implies {shape}")
    return t


def _stacked_weights(moe: MoEArch, pre: str, path: tuple[str | int, ...], hidden: int
                     ) -> list[WeightSource]:
    """GPT-OSS's router and experts (see above) in the layer's layouts: gate/up's
    interleaved rows `[E, 2I, H]` become `[E, 2, I, H]`, its bias `[E, 2, I]`; float
    weights are turned to `[out, in]`, MXFP4 ones already are."""
    e, i, x = moe.num_experts, moe.intermediate_size, pre + "experts."

    def gate_up(w: np.ndarray) -> np.ndarray:  # [E, 2I, H], row 2j gate j, 2j + 1 up j
        return w.reshape(e, i, 2, hidden).transpose(0, 2, 1, 3)

    def gate_up_bias(ts: list[np.ndarray]) -> np.ndarray:
        return _shaped(ts[0], (e, 2 * i), x + "gate_up_proj_bias").reshape(
            e, i, 2).transpose(0, 2, 1)

    def weight(name: str, out_in: tuple[int, int], layout: Any = None) -> WeightSource:
        def combine(ts: list[np.ndarray]) -> np.ndarray:
            if moe.mxfp4:
                w = _shaped(mxfp4.dequantize(*ts, name=f"{x}{name}_blocks"), (e, *out_in),
                            f"{x}{name}_blocks (dequantized, [E, out, in])")
            else:
                w = np.swapaxes(_shaped(ts[0], (e, *out_in[::-1]), x + name), 1, 2)
            return w if layout is None else layout(w)

        stored = (f"{x}{name}_blocks", f"{x}{name}_scales") if moe.mxfp4 else (x + name,)
        return WeightSource(path + (name,), stored, combine)

    return [WeightSource(path + ("router",), (pre + "router.weight",), _only),
            WeightSource(path + ("router_bias",), (pre + "router.bias",), _only),
            weight("gate_up_proj", (2 * i, hidden), gate_up),
            weight("down_proj", (hidden, i)),
            WeightSource(path + ("gate_up_proj_bias",), (x + "gate_up_proj_bias",),
                         gate_up_bias),
            WeightSource(path + ("down_proj_bias",), (x + "down_proj_bias",), _only)]


def _granite_weights(moe: MoEArch, pre: str, path: tuple[str | int, ...], hidden: int
                     ) -> list[WeightSource]:
    """Granite MoE's router and fused experts (see above) in the layer's layouts."""
    e, i = moe.num_experts, moe.intermediate_size

    def gate_up(ts: list[np.ndarray]) -> np.ndarray:  # [E, 2I, H]: gate rows, then up
        return _shaped(ts[0], (e, 2 * i, hidden), pre + "input_linear.weight").reshape(
            e, 2, i, hidden)

    def down(ts: list[np.ndarray]) -> np.ndarray:
        return _shaped(ts[0], (e, hidden, i), pre + "output_linear.weight")

    return [WeightSource(path + ("router",), (pre + "router.layer.weight",), _only),
            WeightSource(path + ("gate_up_proj",), (pre + "input_linear.weight",), gate_up),
            WeightSource(path + ("down_proj",), (pre + "output_linear.weight",), down)]


def granite_shared_weights(moe: MoEArch, layer: int, path: tuple[str | int, ...]
                           ) -> list[WeightSource]:
    """GraniteMoeShared's shared expert (`model.layers.N.shared_mlp`) as the dense gated
    MLP's parameters: its fused `input_linear [2S, H]` split into gate and up."""
    pre = f"model.layers.{layer}.{moe.shared_name}."

    def gate_up(ts: list[np.ndarray]) -> np.ndarray:
        w = ts[0]
        return w.reshape(2, w.shape[0] // 2, *w.shape[1:])

    return [WeightSource(path + ("gate_up_proj", "weight"), (pre + "input_linear.weight",),
                         gate_up),
            WeightSource(path + ("down_proj", "weight"), (pre + "output_linear.weight",), _only)]


def moe_weights(arch: Any, hf_prefix: str, path: tuple[str | int, ...]) -> list[WeightSource]:
    """Router, stacked gate/up `[E, 2, I, H]` and stacked down `[E, H, I]` of the sparse
    layer at `path` (`("layers", i, "mlp")`), each from the per-expert tensors (GPT-OSS:
    the stacked ones, with the router's and experts' biases).
    `arch` is the `DecoderArch` (its `moe`); `hf_prefix` names the dense MLP's module,
    which Mixtral's experts do not live under."""
    moe: MoEArch = arch.moe
    pre = f"model.layers.{path[1]}.{moe.block}."
    if moe.stacked:
        return _stacked_weights(moe, pre, path, arch.hidden_size)
    if moe.granite:
        return _granite_weights(moe, pre, path, arch.hidden_size)
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
    if moe.grouped is not None and moe.grouped.bias:
        out.append(WeightSource(path + ("e_score_correction_bias",),
                                (pre + "gate.e_score_correction_bias",), _only))
    return out + [
        WeightSource(path + ("router",), (pre + "gate.weight",), _only),
        WeightSource(path + ("gate_up_proj",), tuple(
            f"{pre}experts.{e}.{n}.weight" for e in experts for n in (gate, up)), gate_up),
        WeightSource(path + ("down_proj",), tuple(
            f"{pre}experts.{e}.{down}.weight" for e in experts), stack),
    ]
