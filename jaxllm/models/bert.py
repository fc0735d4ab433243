"""BERT-family encoders (Hugging Face `BertModel`) in Flax NNX, for embedding requests.

The encoder reads a ragged batch of whole prompts flattened to `[T]` tokens:
every request is one segment, attention is bidirectional inside a segment and
masked across segments (plain jnp, no KV cache), and positions restart at 0 in
each segment. Weights keep Hugging Face's `[out, in]` orientation; q/k/v are
stacked so a layer runs one matmul for them.

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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, cfg: Any) -> BertArch:
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ParameterError("config.json:hidden_act",
                                 f"{act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        kind = getattr(cfg, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ParameterError("config.json:position_embedding_type",
                                 f"{kind!r} is not supported; supported: 'absolute'")
        heads = int(cfg.num_attention_heads)
        if int(cfg.hidden_size) % heads:
            raise ParameterError("config.json:num_attention_heads",
                                 f"{heads} does not divide hidden_size={cfg.hidden_size}")
        return cls(vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                   intermediate_size=int(cfg.intermediate_size),
                   num_layers=int(cfg.num_hidden_layers), num_heads=heads,
                   max_positions=int(cfg.max_position_embeddings),
                   type_vocab_size=int(getattr(cfg, "type_vocab_size", 2) or 1),
                   layer_norm_eps=float(getattr(cfg, "layer_norm_eps", 1e-12)),
                   hidden_act=act)


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

    def __init__(self, hf_config: Any, *, dtype: str | jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: Any = None, swiglu: Any = None, tensor_parallel_size: int = 1):
        # attn_backend, swiglu: the loader's decoder knobs; an encoder attends in jnp.
        arch = BertArch.from_hf_config(hf_config)
        dtype = jnp.dtype(dtype)
        self.arch = arch
        h = arch.hidden_size
        self.word_embeddings = _param(rngs, (arch.vocab_size, h), dtype, P(None, None))
        self.position_embeddings = _param(rngs, (arch.max_positions, h), dtype, P(None, None))
        # Token type 0 only: an embedding request is one text.
        self.token_type_embedding = _param(rngs, (h,), dtype, P(None))
        self.embed_norm = _param(rngs, (2, h), dtype, P(None, None), "zeros")
        self.layers = nnx.List([BertLayer(arch, dtype=dtype, rngs=rngs)
                                for _ in range(arch.num_layers)])

    def __call__(self, input_ids: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        """Hidden states `[T, hidden]` of a flat batch: token t belongs to segment
        `segment_ids[t]` (padding tokens carry a segment of their own) at `positions[t]`."""
        x = (jnp.take(self.word_embeddings[...], input_ids, axis=0)
             + jnp.take(self.position_embeddings[...], positions, axis=0)
             + self.token_type_embedding[...])
        norm = self.embed_norm[...]
        x = layer_norm(x, norm[0], norm[1], self.arch.layer_norm_eps)
        mask = segment_ids[:, None] == segment_ids[None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x

    @staticmethod
    def hf_weight_map(hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """Where each parameter comes from in a Hugging Face `BertModel` checkpoint."""
        arch = BertArch.from_hf_config(hf_config)
        n, d = arch.num_heads, arch.head_dim

        def only(ts: list) -> Any:
            return ts[0]

        def stack(ts: list) -> Any:
            return np.stack(ts, axis=0)

        def heads(ts: list) -> Any:
            return np.stack([t.reshape(n, d, *t.shape[1:]) for t in ts], axis=0)

        def o_heads(ts: list) -> Any:
            return ts[0].reshape(ts[0].shape[0], n, d)

        e = "embeddings."
        out = [WeightSource(("word_embeddings",), (e + "word_embeddings.weight",), only),
               WeightSource(("position_embeddings",), (e + "position_embeddings.weight",), only),
               WeightSource(("token_type_embedding",), (e + "token_type_embeddings.weight",),
                            lambda ts: ts[0][0]),
               WeightSource(("embed_norm",), (e + "LayerNorm.weight", e + "LayerNorm.bias"),
                            stack)]
        for i in range(arch.num_layers):
            p, path = f"encoder.layer.{i}.", ("layers", i)
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
                WeightSource(path + ("norm_weight",), tuple(p + f"{x}.weight" for x in ln),
                             stack),
                WeightSource(path + ("norm_bias",), tuple(p + f"{x}.bias" for x in ln), stack),
            ]
        return out

    @staticmethod
    def hf_ignored_tensor(hf_config: Any, name: str) -> bool:
        """The pooler head (sentence embeddings pool hidden states instead) and the
        position-id buffer old exporters saved."""
        return name.startswith("pooler.") or name == "embeddings.position_ids"
