"""The generic decoder's attention block (models/decoder.py): the fused qkv projection,
the backend's rope, cache write and attention, and the per-family steps between them
(OLMo 2's q/k norms over every head, OLMoE's clamp, Ministral 3's query scale)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.kv_groups import KVCacheGroups
from jaxllm.layers.attention import AttentionBackend, AttentionMetadata
from jaxllm.layers.linear import Linear
from jaxllm.layers.mlp import SwiGLU
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.quant import linear_method
from jaxllm.models.decoder_arch import DecoderArch


class DecoderAttention(nnx.Module):
    def __init__(self, arch: DecoderArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: AttentionBackend, swiglu: SwiGLU):
        kv, g, d, h = arch.num_kv_heads, arch.group, arch.head_dim, arch.hidden_size
        self.group = g
        self.qkv_proj = Linear((kv, g + 2, d), (h,), P("model", None, None, None), dtype=dtype,
                               rngs=rngs, bias=arch.qkv_bias,
                               method=linear_method(arch.quantization))
        self.o_proj = Linear((h,), (arch.num_heads, d), P(None, "model", None), dtype=dtype,
                             rngs=rngs, bias=arch.o_bias, bias_spec=P(None),
                             matmul_add=swiglu.matmul_add,
                             method=linear_method(arch.quantization))
        self.qk_norm, self.eps, self.offset = arch.qk_norm, arch.rms_norm_eps, arch.norm_offset
        self.qk_norm_whole, self.clip_qkv = arch.qk_norm_whole, arch.clip_qkv
        self.q_position_scale = arch.q_position_scale
        self.rope = arch.ropes[layer]
        self.sm_scale = arch.sm_scale
        self.soft_cap = arch.attn_soft_cap
        self.sliding_window = arch.sliding_windows[layer]
        self.place_in_cache(arch, layer, attn_backend)

    def place_in_cache(self, arch: DecoderArch, layer: int,
                       attn_backend: AttentionBackend) -> None:
        """Where this layer's pages sit in the one cache array (`cache_pages`)."""
        self.attn_backend = attn_backend
        self.layer, self.num_layers = layer, arch.num_layers
        groups = KVCacheGroups.from_windows(arch.sliding_windows)
        self.kv_group, self.kv_slot = groups.layer_group[layer], groups.layer_slot[layer]
        self.pages_per_block = groups.group_size

    def cache_pages(self, md: AttentionMetadata, kv_cache: jax.Array
                    ) -> tuple[AttentionMetadata, int]:
        """This layer's metadata and the offset of its first page in `kv_cache`."""
        if md.grouped:  # KV cache groups (jaxllm/kv_groups.py): this layer's group and slot
            return (md.for_group(self.kv_group),
                    self.kv_slot * (kv_cache.shape[0] // self.pages_per_block))
        # every layer's pages; this layer's come after the previous ones'
        return md, self.layer * (kv_cache.shape[0] // self.num_layers)

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata, qk_norms: jax.Array | None, residual: jax.Array,
                 post_norm: jax.Array | None = None, rows: jax.Array | None = None,
                 write: bool = True, kv_scale: jax.Array | None = None,
                 sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """`residual` plus the attention block's output (for the normed input `x`;
        normed by `post_norm` first where given), and the updated cache. The rest as in `heads`."""
        o, residual, kv_cache = self.heads(x, positions, kv_cache, md, qk_norms, residual,
                                           rows, write, kv_scale, sinks)
        if post_norm is None:
            return self.o_proj.add(o, residual), kv_cache
        return residual + rms_norm(self.o_proj(o), post_norm, self.eps, self.offset), kv_cache

    def heads(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
              md: AttentionMetadata, qk_norms: jax.Array | None, residual: jax.Array,
              rows: jax.Array | None = None, write: bool = True,
              kv_scale: jax.Array | None = None, sinks: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The attention heads' output before the output projection, `residual` at the
        same rows, and the updated cache.

        `rows` (one per request, its last token): every token's K/V still goes to the
        cache, but only those rows' outputs are computed and returned. `write=False`:
        this step's K/V are in the cache already (`DecoderForCausalLM.finish_states`).
        `kv_scale` `[2]`: an fp8 cache's K and V scales, q's as `project_qkv` applies it
        and V's to the output (P (v_scale V) = v_scale (P V)), so bodies only upcast.
        `sinks` `[num_heads]` float32: this layer's sink logits (GPT-OSS), in query-head
        order, which the fused qkv layout keeps (checkpoint order, kv copies too)."""
        md, page_offset = self.cache_pages(md, kv_cache)
        if self.qk_norm_whole:  # the norms span every shard's heads: no split-K partials
            qkv = whole_qk_norm(self.qkv_proj(x), qk_norms[self.layer], self.eps)
            if self.clip_qkv is not None:
                qkv = jnp.clip(qkv, -self.clip_qkv, self.clip_qkv)
        else:
            qkv = self.qkv_proj.split(
                x, self.attn_backend.qkv_parts(x.shape[0], self.rope, write, kv_scale))
        q, kv_cache = self.attn_backend.project_qkv(
            qkv, positions, kv_cache, md, page_offset, rope=self.rope,
            qk_norms=qk_norms if self.qk_norm else None, layer=self.layer, eps=self.eps,
            offset=self.offset, kv_scale=kv_scale, write=write, dtype=x.dtype)
        if self.q_position_scale is not None:
            q = q * position_scale(positions, *self.q_position_scale).astype(q.dtype)
        if rows is not None:
            q, residual, md = q[rows], residual[rows], md.last_queries()
        o = self.attn_backend.attend(q, kv_cache, md, sm_scale=self.sm_scale,
                                     sliding_window=self.sliding_window,
                                     soft_cap=self.soft_cap, page_offset=page_offset,
                                     sinks=sinks)
        if kv_scale is not None:
            o = o * kv_scale[1].astype(o.dtype)
        return o, residual, kv_cache


def position_scale(positions: jax.Array, beta: float, length: int) -> jax.Array:
    """Ministral 3's query scale per token `[T, 1, 1]`: 1 + beta * log(1 + floor(p / length))
    (1 within the first `length` positions)."""
    p = positions.astype(jnp.float32)
    return (1.0 + beta * jnp.log1p(jnp.floor(p / length)))[:, None, None]


def whole_qk_norm(qkv: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """OLMo 2's q and k norms on the fused projection `[T, KV, G + 2, D]`: each token's
    query heads normed together, and its key heads, then scaled by `weight [KV, G + 1, D]`
    (q's then k's, in the fused layout); V passes. Under tensor parallelism the mean
    spans the shards (a sum across them); replicated kv heads leave K's mean unchanged,
    every checkpoint head being counted equally often."""
    g = qkv.shape[2] - 2
    x32 = qkv[:, :, :g + 1].astype(jnp.float32)

    def normed(y: jax.Array) -> jax.Array:
        return y * jax.lax.rsqrt(jnp.mean(y * y, axis=(1, 2, 3), keepdims=True) + eps)

    qk = jnp.concatenate([normed(x32[:, :, :g]), normed(x32[:, :, g:])], axis=2)
    return jnp.concatenate([weight * qk.astype(qkv.dtype), qkv[:, :, g + 1:]], axis=2)
