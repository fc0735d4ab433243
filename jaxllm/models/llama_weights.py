"""The Llama family's static shape (`LlamaArch`, read once from a Hugging Face config)
and where each of its parameters comes from in a Hugging Face checkpoint.

The fused layouts are models/llama.py's: qkv grouped by kv head (its G query
heads, then its k and v heads), kv heads replicated when there are fewer than
tensor-parallel shards; gate/up stacked; o_proj split by head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.models.moe_weights import MOE_MODEL_TYPES, MoEArch, moe_weight_sources

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)


@dataclass(frozen=True)
class LlamaArch:
    """The static shape of a Llama-family model, read once from its HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    kv_replicas: int = 1  # copies of each checkpoint kv head (fewer kv heads than shards)
    moe: MoEArch | None = None  # the routed experts (Mixtral, Qwen3-MoE)

    @classmethod
    def from_hf_config(cls, cfg: Any, tensor_parallel_size: int = 1) -> LlamaArch:
        """`tensor_parallel_size`: with fewer kv heads than that, each kv head is
        replicated so that every shard holds one (`num_kv_heads` counts the copies)."""
        model_type = getattr(cfg, "model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ParameterError("model", f"model_type {model_type!r} is not a Llama-family "
                                 f"model; supported: {', '.join(MODEL_TYPES)}")
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        if heads % kv_heads:
            raise ParameterError("config.json:num_key_value_heads",
                                 f"{kv_heads} does not divide num_attention_heads={heads}")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ParameterError("config.json:hidden_act", f"{act!r} is not supported; "
                                 "supported: 'silu'")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        replicas = max(1, tensor_parallel_size // kv_heads)
        return cls(
            model_type=model_type,
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=kv_heads * replicas,
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            rms_norm_eps=float(cfg.rms_norm_eps),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_windows=_sliding_windows(cfg),
            kv_replicas=replicas,
            moe=MoEArch.from_hf_config(cfg),
        )

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the routed experts (else the dense SwiGLU)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _sliding_windows(cfg: Any) -> tuple[int | None, ...]:
    window = getattr(cfg, "sliding_window", None)
    n = int(cfg.num_hidden_layers)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:  # Mistral: one window for every layer (None: full attention)
        return (int(window) if window else None,) * n
    return tuple(int(window) if t == "sliding_attention" and window else None
                 for t in layer_types)


# ---- Hugging Face checkpoint layout -------------------------------------------------------

@dataclass(frozen=True)
class WeightSource:
    """How one parameter is built from checkpoint tensors (numpy, on the host)."""

    path: tuple[str | int, ...]  # the parameter's path in the module state
    tensors: tuple[str, ...]  # HF tensor names it is built from
    combine: Callable[[list[np.ndarray]], np.ndarray]


def _only(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0]


def hf_weight_map(arch: LlamaArch) -> list[WeightSource]:
    """Every parameter of the module with the HF tensors it comes from."""
    kv, g, d, h = arch.num_kv_heads, arch.group, arch.head_dim, arch.hidden_size
    copies = arch.kv_replicas

    def fuse_qkv(ts: list[np.ndarray]) -> np.ndarray:
        # q rows are head-major (head = kv * G + g), so grouping by kv head is a reshape;
        # copy c of checkpoint kv head j is kv head j * copies + c, and reads the c-th
        # run of j's query heads.
        q, k, v = ts
        tail = q.shape[1:]  # (hidden,) for weights, () for biases

        def kv_heads(t: np.ndarray) -> np.ndarray:
            t = t.reshape(kv // copies, 1, d, *tail)
            return t if copies == 1 else np.repeat(t, copies, axis=0)

        return np.concatenate([q.reshape(kv, g, d, *tail), kv_heads(k), kv_heads(v)], axis=1)

    def o_heads(ts: list[np.ndarray]) -> np.ndarray:
        return ts[0].reshape(h, arch.num_heads, d)

    def stack(ts: list[np.ndarray]) -> np.ndarray:
        return np.stack(ts, axis=0)

    def by_layer(ts: list[np.ndarray]) -> np.ndarray:
        stacked = np.stack(ts, axis=0)
        return stacked.reshape(arch.num_layers, -1, *stacked.shape[1:])

    layers = range(arch.num_layers)
    out = [WeightSource(("embed_tokens",), ("model.embed_tokens.weight",), _only),
           WeightSource(("norm", "weight"), ("model.norm.weight",), _only),
           WeightSource(("layer_norms",), tuple(
               f"model.layers.{i}.{n}.weight" for i in layers
               for n in ("input_layernorm", "post_attention_layernorm")), by_layer)]
    if arch.qk_norm:
        out.append(WeightSource(("qk_norms",), tuple(
            f"model.layers.{i}.self_attn.{n}_norm.weight" for i in layers for n in "qk"),
            by_layer))
    if not arch.tie_word_embeddings:
        out.append(WeightSource(("lm_head",), ("lm_head.weight",), _only))
    for i in range(arch.num_layers):
        pre, at = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        path = ("layers", i)
        out += [
            WeightSource(path + ("self_attn", "qkv_proj"),
                         tuple(f"{at}{p}_proj.weight" for p in "qkv"), fuse_qkv),
            WeightSource(path + ("self_attn", "o_proj"), (at + "o_proj.weight",), o_heads),
        ]
        if arch.sparse(i):
            out += [WeightSource(s.path, s.tensors, s.combine)
                    for s in moe_weight_sources(arch.moe, i)]
        else:
            out += [
                WeightSource(path + ("mlp", "gate_up_proj"),
                             (pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"), stack),
                WeightSource(path + ("mlp", "down_proj"), (pre + "mlp.down_proj.weight",), _only),
            ]
        if arch.qkv_bias:
            out.append(WeightSource(path + ("self_attn", "qkv_bias"),
                                    tuple(f"{at}{p}_proj.bias" for p in "qkv"), fuse_qkv))
        if arch.o_bias:
            out.append(WeightSource(path + ("self_attn", "o_bias"), (at + "o_proj.bias",),
                                    _only))
        if arch.mlp_bias and not arch.sparse(i):
            out += [WeightSource(path + ("mlp", "gate_up_bias"),
                                 (pre + "mlp.gate_proj.bias", pre + "mlp.up_proj.bias"), stack),
                    WeightSource(path + ("mlp", "down_bias"), (pre + "mlp.down_proj.bias",),
                                 _only)]
    return out
