"""DeepSeek-V2/V3's multi-head latent attention (MLA) on the paged cache, and where its
weights live in a Hugging Face checkpoint.

The cache keeps what the model itself keeps of a token: the normed latent `c` (
`kv_lora_rank` wide) and the rotated key part `k_pe` shared by every head (`rope_dim`),
as one kv head of `cache_dim = kv_lora_rank + rope_dim` columns. The up projection
`kv_b_proj` is absorbed into the two ends (as vLLM and DeepSeek's own inference run
MLA): a head's no-rope key is `W_UK c`, so its score is
`q_nope . W_UK c + q_pe . k_pe = [W_UK^T q_nope, q_pe] . [c, k_pe]`, and its value is
`W_UV c`, so its output is `W_UV (sum_j p_j c_j)`. Attention is then plain multi-query
attention over the cache's one head, every attention body unchanged: the query is
`[W_UK^T q_nope, q_pe]`, the key `[c, k_pe]`, the value the same vector, of whose
output the first `kv_lora_rank` columns are `sum_j p_j c_j`. The value is stored as a
second copy of the key (the layout keeps K and V apart), so a token costs
`2 * cache_dim` elements a layer: DeepSeek-V3's 1152 against the 40960 of its 128
decompressed heads (vLLM keeps one copy: 576).

Under tensor parallelism the query heads (and their slices of `kv_b_proj`) split over
'model' and every device keeps the whole latent (the kv head replicated, as vLLM's MLA).
The softmax scale is `qk_head_dim ** -0.5`, times `mscale(factor, mscale_all_dim) ** 2`
under yarn, as transformers computes it.

Weights keep `[out, in]`: `q_proj` / `q_b_proj` `[heads, qk_dim, in]`, `kv_a_proj`
`[cache_dim, hidden]` (`kv_a_proj_with_mqa`), `kv_b_proj` `[heads, nope_dim + v_dim,
kv_lora_rank]`, `o_proj` `[hidden, heads, v_dim]`. Interleaved rope pairs (DeepSeek's
layout) are read as rotate-half by permuting the rope rows of q and k as they load
(one permutation of both leaves every score unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.layers.attention import AttentionBackend, AttentionMetadata
from jaxllm.layers.attention_backend import to_fp8_range
from jaxllm.layers.linear import Linear, make_param
from jaxllm.layers.mlp import SwiGLU
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.quant import linear_method
from jaxllm.models.contract import WeightSource
from jaxllm.models.decoder_arch import DecoderArch
from jaxllm.models.decoder_attention import DecoderAttention

LATENT_EPS = 1e-6  # the q and kv latents' RMSNorms (DeepSeek's default, not the config's)


class MLAAttention(DecoderAttention):
    """The decoder's attention block for MLA; `heads` as `DecoderAttention.heads`."""

    def __init__(self, arch: DecoderArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: AttentionBackend, swiglu: SwiGLU):
        mla, heads, hidden = arch.mla, arch.num_heads, arch.hidden_size
        method = linear_method(arch.quantization)
        by_head = P("model", None, None)
        q_lora = mla.q_lora_rank
        self.q_a_proj = nnx.data(Linear((q_lora,), (hidden,), P(None, None), dtype=dtype,
                                        rngs=rngs, bias=mla.bias, method=method)
                                 if q_lora else None)
        self.q_a_norm = nnx.data(make_param(rngs, (q_lora,), dtype, P(None), "ones")
                                 if q_lora else None)
        self.q_b_proj = nnx.data(Linear((heads, mla.qk_dim), (q_lora,), by_head, dtype=dtype,
                                        rngs=rngs, method=method) if q_lora else None)
        self.q_proj = nnx.data(None if q_lora else Linear(
            (heads, mla.qk_dim), (hidden,), by_head, dtype=dtype, rngs=rngs, method=method))
        self.kv_a_proj = Linear((mla.cache_dim,), (hidden,), P(None, None), dtype=dtype,
                                rngs=rngs, bias=mla.bias, method=method)
        self.kv_a_norm = make_param(rngs, (mla.kv_lora_rank,), dtype, P(None), "ones")
        # Absorbed into the query and the output, never applied to the cache: plain.
        self.kv_b_proj = make_param(rngs, (heads, mla.nope_dim + mla.v_dim, mla.kv_lora_rank),
                                    dtype, by_head)
        self.o_proj = Linear((hidden,), (heads, mla.v_dim), P(None, "model", None),
                             dtype=dtype, rngs=rngs, bias=mla.bias, bias_spec=P(None),
                             matmul_add=swiglu.matmul_add, method=method)
        self.mla, self.kv_heads = mla, arch.num_kv_heads
        self.eps, self.offset = arch.rms_norm_eps, False
        self.rope, self.sm_scale = arch.ropes[layer], arch.sm_scale
        self.place_in_cache(arch, layer, attn_backend)

    def heads(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
              md: AttentionMetadata, qk_norms: jax.Array | None, residual: jax.Array,
              rows: jax.Array | None = None, write: bool = True,
              kv_scale: jax.Array | None = None, sinks: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The heads' values `[T, heads, v_dim]` before `o_proj`, `residual` at the same
        rows, and the cache with this step's latents written (module doc)."""
        del qk_norms, sinks  # MLA has neither
        md, page_offset = self.cache_pages(md, kv_cache)
        mla, r = self.mla, self.mla.kv_lora_rank
        if self.q_proj is None:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_norm[...], LATENT_EPS))
        else:
            q = self.q_proj(x)  # [T, heads, qk_dim]
        kv = self.kv_a_proj(x)  # [T, cache_dim]
        latent = rms_norm(kv[:, :r], self.kv_a_norm[...], LATENT_EPS)
        k_pe = self.rope(kv[:, None, r:], positions)
        w_b = self.kv_b_proj[...]
        q = jnp.concatenate([jnp.einsum("thn,hnr->thr", q[..., :mla.nope_dim],
                                        w_b[:, :mla.nope_dim]),
                             self.rope(q[..., mla.nope_dim:], positions)], axis=-1)
        k = jnp.broadcast_to(jnp.concatenate([latent[:, None], k_pe], axis=-1),
                             (x.shape[0], self.kv_heads, mla.cache_dim))
        if write:
            if kv_scale is None:
                kv_cache = self.attn_backend.write_kv(kv_cache, k, k, md, page_offset)
            else:  # an fp8 cache: as the base's project_qkv, V being the same vector
                kv_cache = self.attn_backend.write_kv(
                    kv_cache, to_fp8_range(k, kv_scale[0]), to_fp8_range(k, kv_scale[1]),
                    md, page_offset)
        if kv_scale is not None:
            q = q * kv_scale[0].astype(q.dtype)
        if rows is not None:
            q, residual, md = q[rows], residual[rows], md.last_queries()
        o = self.attn_backend.attend(q, kv_cache, md, sm_scale=self.sm_scale,
                                     page_offset=page_offset)
        if kv_scale is not None:
            o = o * kv_scale[1].astype(o.dtype)
        return (jnp.einsum("thr,hvr->thv", o[..., :r], w_b[:, mla.nope_dim:]), residual,
                kv_cache)


def mla_weights(arch: DecoderArch, layer: int) -> list[WeightSource]:
    """One layer's MLA parameters from the checkpoint's `self_attn` tensors."""
    mla, heads = arch.mla, arch.num_heads
    at, path = f"model.layers.{layer}.self_attn.", ("layers", layer, "self_attn")
    rope = np.arange(mla.rope_dim)
    if mla.interleaved:  # the pairs' even members, then their odd ones (module doc)
        rope = np.concatenate([rope[0::2], rope[1::2]])

    def q_heads(ts: list[np.ndarray]) -> np.ndarray:  # [heads * qk_dim, in]
        q = ts[0].reshape(heads, mla.qk_dim, -1)
        return np.concatenate([q[:, :mla.nope_dim], q[:, mla.nope_dim + rope]], axis=1)

    def kv_a(ts: list[np.ndarray]) -> np.ndarray:  # [cache_dim, ...]: latent rows, rope rows
        t = ts[0]
        return np.concatenate([t[:mla.kv_lora_rank], t[mla.kv_lora_rank + rope]], axis=0)

    def only(ts: list[np.ndarray]) -> np.ndarray:
        return ts[0]

    def by_head(ts: list[np.ndarray]) -> np.ndarray:
        return ts[0].reshape(heads, mla.nope_dim + mla.v_dim, mla.kv_lora_rank)

    def o_heads(ts: list[np.ndarray]) -> np.ndarray:
        return ts[0].reshape(arch.hidden_size, heads, mla.v_dim)

    out = [WeightSource(path + ("kv_a_proj", "weight"), (at + "kv_a_proj_with_mqa.weight",),
                        kv_a),
           WeightSource(path + ("kv_a_norm",), (at + "kv_a_layernorm.weight",), only),
           WeightSource(path + ("kv_b_proj",), (at + "kv_b_proj.weight",), by_head),
           WeightSource(path + ("o_proj", "weight"), (at + "o_proj.weight",), o_heads)]
    if mla.q_lora_rank:
        out += [WeightSource(path + ("q_a_proj", "weight"), (at + "q_a_proj.weight",), only),
                WeightSource(path + ("q_a_norm",), (at + "q_a_layernorm.weight",), only),
                WeightSource(path + ("q_b_proj", "weight"), (at + "q_b_proj.weight",),
                             q_heads)]
    else:
        out.append(WeightSource(path + ("q_proj", "weight"), (at + "q_proj.weight",), q_heads))
    if mla.bias:
        out += [WeightSource(path + ("kv_a_proj", "bias"), (at + "kv_a_proj_with_mqa.bias",),
                             kv_a),
                WeightSource(path + ("o_proj", "bias"), (at + "o_proj.bias",), only)]
        if mla.q_lora_rank:
            out.append(WeightSource(path + ("q_a_proj", "bias"), (at + "q_a_proj.bias",), only))
    return out
