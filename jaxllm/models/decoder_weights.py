"""Where each parameter of the generic decoder comes from in a Hugging Face checkpoint.

The fused layouts are models/decoder.py's: qkv grouped by kv head (its G query
heads, then its k and v heads), kv heads replicated when there are fewer than
tensor-parallel shards; gate/up stacked; o_proj split by head; every layer's
norms stacked into one array (`DecoderArch.norm_names` says which, in order), and
GPT-OSS's attention sinks into another, `[layers, heads]` in checkpoint head order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.models.contract import WeightSource
from jaxllm.models.decoder_arch import DecoderArch
from jaxllm.models.mla import mla_weights
from jaxllm.models.moe_weights import granite_shared_weights, moe_weights


def _only(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0]


def _stack(ts: list[np.ndarray]) -> np.ndarray:
    return np.stack(ts, axis=0)


def rope_order(arch: DecoderArch) -> np.ndarray | None:
    """Where each head dimension of q and k is read from for a family that rotates
    interleaved pairs (GLM, ERNIE): the rotated dimensions' even ones, then their odd
    ones, then the rest. That turns the pairs' rotation into the rotate-half one the
    attention applies, and q.k is unchanged by one permutation of both; None for the
    rotate-half families."""
    if not arch.rope_interleaved:
        return None
    rd, d = arch.ropes[0].rotary_dim, arch.head_dim
    return np.concatenate([np.arange(0, rd, 2), np.arange(1, rd, 2), np.arange(rd, d)])


def hf_weight_map(arch: DecoderArch) -> list[WeightSource]:
    """Every parameter of the module with the HF tensors it comes from."""
    kv, g, d, h = arch.num_kv_heads, arch.group, arch.head_dim, arch.hidden_size
    copies = arch.kv_replicas
    order = rope_order(arch)

    def reorder(t: np.ndarray) -> np.ndarray:  # q or k rows `[heads * D, ...]`
        return t if order is None else t.reshape(-1, d, *t.shape[1:])[:, order].reshape(t.shape)

    def fuse_qkv(ts: list[np.ndarray]) -> np.ndarray:
        # q rows are head-major (head = kv * G + g), so grouping by kv head is a reshape;
        # copy c of checkpoint kv head j is kv head j * copies + c, and reads the c-th
        # run of j's query heads. `ts`: q and k, then v where the tensor has it (OLMo 2's
        # whole q/k norm weights are q's and k's only).
        q, k, *v = ts
        tail = q.shape[1:]  # (hidden,) for weights, () for biases and norm weights

        def kv_heads(t: np.ndarray) -> np.ndarray:
            t = t.reshape(kv // copies, 1, d, *tail)
            return t if copies == 1 else np.repeat(t, copies, axis=0)

        return np.concatenate([reorder(q).reshape(kv, g, d, *tail), kv_heads(reorder(k)),
                               *map(kv_heads, v)], axis=1)

    def o_heads(ts: list[np.ndarray]) -> np.ndarray:
        return ts[0].reshape(h, arch.num_heads, d)

    def by_layer(ts: list[np.ndarray]) -> np.ndarray:
        stacked = np.stack(ts, axis=0)
        return stacked.reshape(arch.num_layers, -1, *stacked.shape[1:])

    layers = range(arch.num_layers)
    out = [WeightSource(("embed_tokens",), ("model.embed_tokens.weight",), _only),
           WeightSource(("norm", "weight"), ("model.norm.weight",), _only),
           WeightSource(("layer_norms",), tuple(
               f"model.layers.{i}.{n}.weight" for i in layers
               for n in arch.norm_names), by_layer)]
    qk_norm_names = tuple(f"model.layers.{i}.self_attn.{n}_norm.weight"
                          for i in layers for n in "qk")
    if arch.qk_norm:
        out.append(WeightSource(("qk_norms",), qk_norm_names,
                                lambda ts: by_layer([reorder(t) for t in ts])))
    if arch.qk_norm_whole:  # `[L, KV, G + 1, D]`: laid out as the fused projection's heads
        out.append(WeightSource(("qk_norms",), qk_norm_names, lambda ts: np.stack(
            [fuse_qkv(ts[i:i + 2]) for i in range(0, len(ts), 2)])))
    if arch.attn_sinks:
        out.append(WeightSource(("attn_sinks",), tuple(
            f"model.layers.{i}.self_attn.sinks" for i in layers), _stack))
    if not arch.tie_word_embeddings:
        out.append(WeightSource(("lm_head",), ("lm_head.weight",), _only))
    for i in range(arch.num_layers):
        at, path = f"model.layers.{i}.self_attn.", ("layers", i, "self_attn")
        if arch.mla is not None:  # DeepSeek's latent attention: its own projections
            out += mla_weights(arch, i) + MLP_WEIGHTS[arch.mlp_kinds[i]](
                arch, f"model.layers.{i}.mlp.", ("layers", i, "mlp"))
            continue
        out += [
            WeightSource(path + ("qkv_proj", "weight"),
                         tuple(f"{at}{p}_proj.weight" for p in "qkv"), fuse_qkv),
            WeightSource(path + ("o_proj", "weight"), (at + "o_proj.weight",), o_heads),
        ]
        if arch.qkv_bias:
            out.append(WeightSource(path + ("qkv_proj", "bias"),
                                    tuple(f"{at}{p}_proj.bias" for p in "qkv"), fuse_qkv))
        if arch.o_bias:
            out.append(WeightSource(path + ("o_proj", "bias"), (at + "o_proj.bias",), _only))
        out += MLP_WEIGHTS[arch.mlp_kinds[i]](arch, f"model.layers.{i}.mlp.",
                                              ("layers", i, "mlp"))
    return out


def gated_mlp_weights(arch: DecoderArch, hf_prefix: str,
                      path: tuple[str | int, ...]) -> list[WeightSource]:
    """The dense gated MLP's (layers/gated_mlp.py) parameters."""

    def stack(ts: list[np.ndarray]) -> np.ndarray:
        return np.stack(ts, axis=0)

    out = [WeightSource(path + ("gate_up_proj", "weight"),
                        (hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight"), stack),
           WeightSource(path + ("down_proj", "weight"), (hf_prefix + "down_proj.weight",), _only)]
    if arch.mlp_bias:
        out += [WeightSource(path + ("gate_up_proj", "bias"),
                             (hf_prefix + "gate_proj.bias", hf_prefix + "up_proj.bias"), stack),
                WeightSource(path + ("down_proj", "bias"), (hf_prefix + "down_proj.bias",), _only)]
    return out


def plain_mlp_weights(arch: DecoderArch, hf_prefix: str,
                      path: tuple[str | int, ...]) -> list[WeightSource]:
    """The non-gated MLP's (layers/gated_mlp.PlainMLP) parameters."""
    names = ("up_proj", "down_proj")
    out = [WeightSource(path + (n, "weight"), (f"{hf_prefix}{n}.weight",), _only) for n in names]
    if arch.mlp_bias:
        out += [WeightSource(path + (n, "bias"), (f"{hf_prefix}{n}.bias",), _only) for n in names]
    if arch.activation == "xielu":  # its learned scalars, as one [4] array
        out.append(WeightSource(path + ("act_params",), tuple(
            f"{hf_prefix}act_fn.{p}" for p in ("alpha_p", "alpha_n", "beta", "eps")),
            lambda ts: np.concatenate([t.reshape(-1) for t in ts])))
    return out


def sparse_mlp_weights(arch: DecoderArch, hf_prefix: str,
                       path: tuple[str | int, ...]) -> list[WeightSource]:
    """A sparse layer's router and experts, and its shared expert where it has one."""
    out = moe_weights(arch, hf_prefix, path)
    if arch.moe.shared_intermediate_size and arch.moe.granite:
        out += granite_shared_weights(arch.moe, int(path[1]), path + ("shared_expert",))
    elif arch.moe.shared_intermediate_size:
        out += gated_mlp_weights(dataclasses.replace(arch, mlp_bias=False),
                                 f"{hf_prefix}{arch.moe.shared_name}.", path + ("shared_expert",))
    return out


# Per-layer MLP kind (`DecoderArch.mlp_kinds`) -> its parameters' sources (the MLP
# modules themselves: models/decoder_mlps.py's MLP_FACTORIES).
MLP_WEIGHTS = {"dense": gated_mlp_weights, "plain": plain_mlp_weights, "moe": sparse_mlp_weights}


def read_fused(sources: list[WeightSource],
               fused: dict[str, tuple[str, tuple[int, ...]]]) -> list[WeightSource]:
    """`sources` for a checkpoint that fuses some projections itself (Phi-3's
    `qkv_proj` and `gate_up_proj`, GLM's `gate_up_proj`): a source whose first tensor
    is module `m` of `fused` (`{m: (fused module, its row blocks' sizes)}`) reads the
    fused tensor instead and cuts it into those row blocks before its own combine."""
    out = []
    for src in sources:
        prefix, _, first = src.tensors[0].rpartition(".")[0].rpartition(".")
        if first not in fused:
            out.append(src)
            continue
        name, sizes = fused[first]
        out.append(WeightSource(src.path, (f"{prefix}.{name}.weight",),
                                _split_rows(sizes, src.combine)))
    return out


def _split_rows(sizes: tuple[int, ...], combine: Any) -> Any:
    cuts = np.cumsum(sizes)[:-1]

    def split(ts: list[np.ndarray]) -> np.ndarray:
        (tensor,) = ts
        if tensor.shape[0] != sum(sizes):
            raise ParameterError("model", f"fused tensor has {tensor.shape[0]} rows; "
                                 f"config.json implies {sum(sizes)}")
        return combine(np.split(tensor, cuts, axis=0))

    return split
