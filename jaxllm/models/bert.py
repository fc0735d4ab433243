"""BERT-family encoders (Hugging Face `BertModel`, `RobertaModel`, `XLMRobertaModel`) in
Flax NNX, for embedding requests; the cross-encoders' heads build on them (cross_encoder.py).

The encoder reads a ragged batch of whole prompts flattened to `[T]` tokens:
every request is one segment, attention is bidirectional inside a segment and
masked across segments (plain jnp, no KV cache), and positions restart at 0 in
each segment (RoBERTa's embedding rows start at `padding_idx + 1`). Each token
carries a token type (0, or 1 for a BERT text pair's second text). Weights keep
Hugging Face's `[out, in]` orientation; q/k/v are stacked so a layer runs one
matmul for them.

Sharding over the mesh axis 'model', as Megatron splits a layer:

  weight        shape                  spec                     role
  qkv_proj      [3, heads, D, hidden]  (None, 'model', ...)     column-parallel
  o_proj        [hidden, heads, D]     (None, 'model', None)    row-parallel
  up_proj       [inter, hidden]        ('model', None)          column-parallel
  down_proj     [hidden, inter]        (None, 'model')          row-parallel
  embeddings, LayerNorms, biases of row-parallel outputs        replicated
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError
from jaxllm.layers.linear import make_param as _param
from jaxllm.models.contract import WeightSource

_ACTIVATIONS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False),
                "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                "relu": jax.nn.relu}


@dataclass(frozen=True)
class BertArch:
    """The static shape of a BERT encoder, read once from its HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    # Row of position 0 in the position table: RoBERTa numbers positions from
    # padding_idx + 1 (transformers' create_position_ids_from_input_ids).
    position_offset: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def usable_positions(self) -> int:
        """The longest prompt the position table holds."""
        return self.max_positions - self.position_offset

    @classmethod
    def from_hf_config(cls, cfg: Any, position_offset: int = 0) -> BertArch:
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ParameterError("config.json:hidden_act",
                                 f"{act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        kind = getattr(cfg, "position_embedding_type", None) or "absolute"
        if kind != "absolute":
            raise ParameterError("config.json:position_embedding_type",
                                 f"{kind!r} is not supported; supported: 'absolute'")
        heads = int(cfg.num_attention_heads)
        if int(cfg.hidden_size) % heads:
            raise ParameterError("config.json:num_attention_heads",
                                 f"{heads} does not divide hidden_size={cfg.hidden_size}")
        if int(cfg.max_position_embeddings) <= position_offset:
            raise ParameterError("config.json:max_position_embeddings",
                                 f"{cfg.max_position_embeddings} leaves no position after "
                                 f"the offset padding_idx + 1 = {position_offset}")
        return cls(vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                   intermediate_size=int(cfg.intermediate_size),
                   num_layers=int(cfg.num_hidden_layers), num_heads=heads,
                   max_positions=int(cfg.max_position_embeddings),
                   type_vocab_size=int(getattr(cfg, "type_vocab_size", 2) or 1),
                   layer_norm_eps=float(getattr(cfg, "layer_norm_eps", 1e-12)),
                   hidden_act=act, position_offset=position_offset)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, statistics in float32 (as PyTorch's kernel)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class BertLayer(nnx.Module):
    def __init__(self, arch: BertArch, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, n, d, i = arch.hidden_size, arch.num_heads, arch.head_dim, arch.intermediate_size
        self.qkv_proj = _param(rngs, (3, n, d, h), dtype, P(None, "model", None, None))
        self.qkv_bias = _param(rngs, (3, n, d), dtype, P(None, "model", None), "zeros")
        self.o_proj = _param(rngs, (h, n, d), dtype, P(None, "model", None))
        self.o_bias = _param(rngs, (h,), dtype, P(None), "zeros")
        self.up_proj = _param(rngs, (i, h), dtype, P("model", None))
        self.up_bias = _param(rngs, (i,), dtype, P("model"), "zeros")
        self.down_proj = _param(rngs, (h, i), dtype, P(None, "model"))
        self.down_bias = _param(rngs, (h,), dtype, P(None), "zeros")
        # [attention output, layer output] LayerNorm weight and bias.
        self.norm_weight = _param(rngs, (2, h), dtype, P(None, None), "ones")
        self.norm_bias = _param(rngs, (2, h), dtype, P(None, None), "zeros")
        self.eps = arch.layer_norm_eps
        self.act = _ACTIVATIONS[arch.hidden_act]
        self.sm_scale = d ** -0.5

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """`x` `[T, hidden]`; `mask` `[T, T]`: True where query row t may read key column s."""
        qkv = jnp.einsum("th,cndh->ctnd", x, self.qkv_proj[...]) + self.qkv_bias[...][:, None]
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = jnp.einsum("tnd,snd->nts", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[None], scores * self.sm_scale, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = jnp.einsum("nts,snd->tnd", probs, v)
        attn = jnp.einsum("tnd,hnd->th", o, self.o_proj[...]) + self.o_bias[...]
        w, b = self.norm_weight[...], self.norm_bias[...]
        x = layer_norm(attn + x, w[0], b[0], self.eps)
        up = self.act(jnp.einsum("th,ih->ti", x, self.up_proj[...]) + self.up_bias[...])
        down = jnp.einsum("ti,hi->th", up, self.down_proj[...]) + self.down_bias[...]
        return layer_norm(down + x, w[1], b[1], self.eps)


class BertModel(nnx.Module):
    """A BERT encoder over a ragged batch of whole prompts; no KV cache."""

    is_encoder = True  # the engine runs it with the encoder runner (worker/encoder_runner.py)
    # The checkpoint prefixes a trunk may carry (a task model's, or vLLM's "model.").
    trunk_prefixes = ("", "bert.", "model.")

    def __init__(self, hf_config: Any, *, dtype: str | jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: Any = None, swiglu: Any = None, tensor_parallel_size: int = 1):
        # attn_backend, swiglu: the loader's decoder knobs; an encoder attends in jnp.
        arch = self.arch_from_hf_config(hf_config)
        dtype = jnp.dtype(dtype)
        self.arch = arch
        h = arch.hidden_size
        self.word_embeddings = _param(rngs, (arch.vocab_size, h), dtype, P(None, None))
        self.position_embeddings = _param(rngs, (arch.max_positions, h), dtype, P(None, None))
        self.token_type_embeddings = _param(rngs, (arch.type_vocab_size, h), dtype,
                                            P(None, None))
        self.embed_norm = _param(rngs, (2, h), dtype, P(None, None), "zeros")
        self.layers = nnx.List([BertLayer(arch, dtype=dtype, rngs=rngs)
                                for _ in range(arch.num_layers)])

    @staticmethod
    def arch_from_hf_config(hf_config: Any) -> BertArch:
        return BertArch.from_hf_config(hf_config)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 token_types: jax.Array) -> jax.Array:
        """Hidden states `[T, hidden]` of a flat batch: token t belongs to segment
        `segment_ids[t]` (padding tokens carry a segment of their own) at `positions[t]`,
        of type `token_types[t]`."""
        x = (jnp.take(self.word_embeddings[...], input_ids, axis=0)
             + jnp.take(self.position_embeddings[...], positions + self.arch.position_offset,
                        axis=0)
             + jnp.take(self.token_type_embeddings[...], token_types, axis=0))
        norm = self.embed_norm[...]
        x = layer_norm(x, norm[0], norm[1], self.arch.layer_norm_eps)
        mask = segment_ids[:, None] == segment_ids[None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x

    @classmethod
    def hf_weight_map(cls, hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """Where each parameter comes from in a Hugging Face `BertModel` checkpoint."""
        return trunk_weight_map(cls.arch_from_hf_config(hf_config), "")

    @classmethod
    def hf_checkpoint_renames(cls, hf_config: Any, names: set[str]) -> dict[str, str]:
        """The checkpoint's trunk tensors under their unprefixed names: hub checkpoints
        save the trunk bare (save_pretrained of the base model), under the task model's
        prefix (`roberta.`, `bert.`) or under `model.`."""
        for prefix in cls.trunk_prefixes:
            if prefix + "embeddings.word_embeddings.weight" in names:
                return {n: n[len(prefix):] for n in names if prefix and n.startswith(prefix)}
        return {}

    @staticmethod
    def hf_ignored_tensor(hf_config: Any, name: str) -> bool:
        """Heads an embedding does not use (the pooler: sentence embeddings pool hidden
        states instead; a masked-LM or classifier head) and the buffers old exporters
        saved."""
        return (name.startswith(("pooler.", "lm_head.", "cls.", "classifier."))
                or name in ("embeddings.position_ids", "embeddings.token_type_ids"))


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT's encoder with positions numbered from
    padding_idx + 1 (their checkpoints have one token type)."""

    trunk_prefixes = ("", "roberta.", "model.")

    @staticmethod
    def arch_from_hf_config(hf_config: Any) -> BertArch:
        return BertArch.from_hf_config(hf_config, roberta_position_offset(hf_config))


def roberta_position_offset(hf_config: Any) -> int:
    """RoBERTa's first position row: padding_idx (the pad token id) + 1."""
    pad = getattr(hf_config, "pad_token_id", None)
    if pad is None:
        raise ParameterError("config.json:pad_token_id", "RoBERTa numbers positions from "
                             "padding_idx + 1, so the config must name its pad token id")
    return int(pad) + 1


def trunk_weight_map(arch: BertArch, prefix: str) -> list[WeightSource]:
    """Where the encoder's parameters come from: checkpoint tensors named `prefix` +
    transformers' `BertModel` names."""
    n, d = arch.num_heads, arch.head_dim

    def only(ts: list) -> Any:
        return ts[0]

    def stack(ts: list) -> Any:
        return np.stack(ts, axis=0)

    def heads(ts: list) -> Any:
        return np.stack([t.reshape(n, d, *t.shape[1:]) for t in ts], axis=0)

    def o_heads(ts: list) -> Any:
        return ts[0].reshape(ts[0].shape[0], n, d)

    e = prefix + "embeddings."
    out = [WeightSource(("word_embeddings",), (e + "word_embeddings.weight",), only),
           WeightSource(("position_embeddings",), (e + "position_embeddings.weight",), only),
           WeightSource(("token_type_embeddings",), (e + "token_type_embeddings.weight",),
                        only),
           WeightSource(("embed_norm",), (e + "LayerNorm.weight", e + "LayerNorm.bias"),
                        stack)]
    for i in range(arch.num_layers):
        p, path = f"{prefix}encoder.layer.{i}.", ("layers", i)
        a, ln = p + "attention.", ("attention.output.LayerNorm", "output.LayerNorm")
        out += [
            WeightSource(path + ("qkv_proj",), tuple(
                f"{a}self.{x}.weight" for x in ("query", "key", "value")), heads),
            WeightSource(path + ("qkv_bias",), tuple(
                f"{a}self.{x}.bias" for x in ("query", "key", "value")), heads),
            WeightSource(path + ("o_proj",), (a + "output.dense.weight",), o_heads),
            WeightSource(path + ("o_bias",), (a + "output.dense.bias",), only),
            WeightSource(path + ("up_proj",), (p + "intermediate.dense.weight",), only),
            WeightSource(path + ("up_bias",), (p + "intermediate.dense.bias",), only),
            WeightSource(path + ("down_proj",), (p + "output.dense.weight",), only),
            WeightSource(path + ("down_bias",), (p + "output.dense.bias",), only),
            WeightSource(path + ("norm_weight",), tuple(p + f"{x}.weight" for x in ln), stack),
            WeightSource(path + ("norm_bias",), tuple(p + f"{x}.bias" for x in ln), stack),
        ]
    return out
