"""The Llama-family decoder in Flax NNX: Llama 2/3/3.1, Mistral, Qwen2, Qwen3.

One module covers the four Hugging Face architectures; they differ only in
q/k/v (and o) bias, per-head q/k RMSNorm (Qwen3), the rope parameters and the
sliding window (Mistral; Qwen2/3 per `layer_types`). Weights keep Hugging
Face's `[out, in]` orientation, so loading is reshape/stack, never a transpose;
projections are fused so a layer runs one qkv and one gate/up matmul.

Every weight declares its sharding over the mesh axis 'model':

  weight          shape                      spec                     role
  embed_tokens    [vocab, hidden]            ('model', None)          vocab-parallel
  lm_head         [vocab, hidden]            ('model', None)          vocab-parallel logits
  qkv_proj        [kv_heads, G+2, D, hidden] ('model', ...)           column-parallel
  qkv_bias        [kv_heads, G+2, D]         ('model', ...)
  o_proj          [hidden, heads, D]         (None, 'model', None)    row-parallel
  gate_up_proj    [2, inter, hidden]         (None, 'model', None)    column-parallel
  down_proj       [hidden, inter]            (None, 'model')          row-parallel
  norms, biases of row-parallel outputs      replicated

G = heads // kv_heads. The fused qkv weight groups, per kv head, its G query
heads then its k head then its v head, so sharding the kv-head axis gives every
'model' shard whole q, k and v heads that attend to each other (GQA stays local).
With fewer kv heads than 'model' shards (tensor_parallel_size), each kv head is
replicated tp / kv_heads times and its query heads dealt among the copies, so
`kv_heads` above is then tp and every shard holds one kv head (as vLLM does).
Tied embeddings reuse `embed_tokens` for the logits (both vocab-sharded).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.layers.attention import AttentionBackend, AttentionMetadata
from jaxllm.layers.mlp import MatmulAdd, SwiGLU
from jaxllm.layers.norm import RMSNorm, rms_norm
from jaxllm.layers.rotary import RotaryEmbedding
from jaxllm.models.llama_weights import LlamaArch, WeightSource, hf_weight_map

_INIT_STD = 0.02  # dummy weights: small enough that activations stay finite


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, spec: P,
           init: str = "normal") -> nnx.Param:
    if init == "normal":
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    else:
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    # Placement happens in the loader (or a jitted init's out_shardings), not here.
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


class LlamaAttention(nnx.Module):
    def __init__(self, arch: LlamaArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: AttentionBackend, rope: RotaryEmbedding,
                 matmul_add: MatmulAdd):
        kv, g, d, h = arch.num_kv_heads, arch.group, arch.head_dim, arch.hidden_size
        self.matmul_add = matmul_add
        self.group = g
        self.qkv_proj = _param(rngs, (kv, g + 2, d, h), dtype, P("model", None, None, None))
        self.qkv_bias = (_param(rngs, (kv, g + 2, d), dtype, P("model", None, None), "zeros")
                         if arch.qkv_bias else None)
        self.o_proj = _param(rngs, (h, arch.num_heads, d), dtype, P(None, "model", None))
        self.o_bias = _param(rngs, (h,), dtype, P(None), "zeros") if arch.o_bias else None
        self.qk_norm, self.eps = arch.qk_norm, arch.rms_norm_eps
        self.rope = rope
        self.sm_scale = d ** -0.5
        self.sliding_window = arch.sliding_windows[layer]
        self.attn_backend = attn_backend
        self.layer, self.num_layers = layer, arch.num_layers

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata, qk_norms: jax.Array | None, residual: jax.Array,
                 rows: jax.Array | None = None, write: bool = True
                 ) -> tuple[jax.Array, jax.Array]:
        """`residual` plus the attention block's output (for the normed input `x`), and
        the updated cache.

        `rows` (one per request, its last token): every token's K/V still goes to the
        cache, but only those rows' outputs are computed and returned. `write=False`:
        this step's K/V are in the cache already (`LlamaForCausalLM.finish_states`).
        """
        qkv = jnp.einsum("th,kgdh->tkgd", x, self.qkv_proj[...])
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        t, kv_heads, _, d = qkv.shape
        q = qkv[:, :, :self.group].reshape(t, kv_heads * self.group, d)
        k, v = qkv[:, :, self.group], qkv[:, :, self.group + 1]
        if self.qk_norm:  # Qwen3: RMSNorm over each head's q and k
            q, k = rms_norm(q, qk_norms[0], self.eps), rms_norm(k, qk_norms[1], self.eps)
        q, k = self.rope(q, positions), self.rope(k, positions)
        # The cache holds every layer's pages; this layer's come after the previous ones'.
        page_offset = self.layer * (kv_cache.shape[0] // self.num_layers)
        if write:
            kv_cache = self.attn_backend.write_kv(kv_cache, k, v, md, page_offset)
        if rows is not None:
            q, residual, md = q[rows], residual[rows], md.last_queries()
        o = self.attn_backend.attend(q, kv_cache, md, sm_scale=self.sm_scale,
                                     sliding_window=self.sliding_window,
                                     page_offset=page_offset)
        w = self.o_proj[...]
        out = self.matmul_add(o.reshape(q.shape[0], -1), w.reshape(w.shape[0], -1), residual,
                              None if self.o_bias is None else self.o_bias[...])
        return out, kv_cache


class LlamaMLP(nnx.Module):
    def __init__(self, arch: LlamaArch, *, dtype: jnp.dtype, rngs: nnx.Rngs, swiglu: SwiGLU):
        i, h = arch.intermediate_size, arch.hidden_size
        self.swiglu = swiglu
        self.gate_up_proj = _param(rngs, (2, i, h), dtype, P(None, "model", None))
        self.down_proj = _param(rngs, (h, i), dtype, P(None, "model"))
        if arch.mlp_bias:
            self.gate_up_bias = _param(rngs, (2, i), dtype, P(None, "model"), "zeros")
            self.down_bias = _param(rngs, (h,), dtype, P(None), "zeros")
        else:
            self.gate_up_bias = self.down_bias = None

    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        """`residual` plus the MLP's output for the normed input `x`."""
        bias = None if self.gate_up_bias is None else self.gate_up_bias[...]
        return self.swiglu.matmul_add(self.swiglu(x, self.gate_up_proj[...], bias),
                                      self.down_proj[...], residual,
                                      None if self.down_bias is None else self.down_bias[...])


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, arch: LlamaArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: AttentionBackend, rope: RotaryEmbedding, swiglu: SwiGLU):
        self.self_attn = LlamaAttention(arch, layer, dtype=dtype, rngs=rngs,
                                        attn_backend=attn_backend, rope=rope,
                                        matmul_add=swiglu.matmul_add)
        self.mlp = LlamaMLP(arch, dtype=dtype, rngs=rngs, swiglu=swiglu)
        self.eps = arch.rms_norm_eps

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata, norms: jax.Array, qk_norms: jax.Array | None,
                 rows: jax.Array | None = None, write: bool = True
                 ) -> tuple[jax.Array, jax.Array]:
        """`norms`: this layer's [input, post-attention] RMSNorm weights `[2, hidden]`;
        `rows`, `write`: as in `LlamaAttention` (the output has `rows`' rows)."""
        x, kv_cache = self.self_attn(rms_norm(x, norms[0], self.eps), positions, kv_cache,
                                     md, qk_norms, residual=x, rows=rows, write=write)
        return self.mlp(rms_norm(x, norms[1], self.eps), residual=x), kv_cache


class LlamaForCausalLM(nnx.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a ragged, paged batch."""

    def __init__(self, hf_config: Any, *, dtype: str | jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: AttentionBackend, swiglu: SwiGLU | None = None,
                 tensor_parallel_size: int = 1):
        arch = LlamaArch.from_hf_config(hf_config, tensor_parallel_size)
        swiglu = swiglu or SwiGLU()
        dtype = jnp.dtype(dtype)
        self.arch = arch
        self.dtype = dtype
        rope = RotaryEmbedding.from_hf_config(hf_config, arch.head_dim)
        self.embed_tokens = _param(rngs, (arch.vocab_size, arch.hidden_size), dtype,
                                   P("model", None))
        self.layers = nnx.List([
            LlamaDecoderLayer(arch, i, dtype=dtype, rngs=rngs, attn_backend=attn_backend,
                              rope=rope, swiglu=swiglu)
            for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps, dtype=dtype)
        # Every layer's RMSNorm weights in one array each (input and post-attention;
        # Qwen3's q and k): a jitted step pays the host per array it takes.
        self.layer_norms = _param(rngs, (arch.num_layers, 2, arch.hidden_size), dtype,
                                  P(None, None, None), "ones")
        self.qk_norms = (_param(rngs, (arch.num_layers, 2, arch.head_dim), dtype,
                                P(None, None, None), "ones") if arch.qk_norm else None)
        self.lm_head = (None if arch.tie_word_embeddings else
                        _param(rngs, (arch.vocab_size, arch.hidden_size), dtype,
                               P("model", None)))

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Hidden states after the final norm `[T, hidden]` and the updated KV cache.

        `kv_cache` holds the pages of every layer, `num_layers` equal runs along
        axis 0 (see jaxllm/layers/attention.py).
        """
        states, kv_cache = self._trunk(input_ids, positions, kv_cache, md)
        x, kv_cache = self._layer(-1, states, positions, kv_cache, md)
        return self.norm(x), kv_cache

    def forward_rows(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                     md: AttentionMetadata, rows: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The forward for the rows whose hidden states are used: `rows` `[R]`, request
        i's last token at row i (`md.cu_q_lens[1:] - 1`; a padding request's value is
        ignored). Returns their hidden states after the final norm `[R, hidden]`, the
        updated cache, and the residual stream entering the last layer `[T, hidden]`
        (`finish_states` turns it into every row's hidden state).

        Equal to `__call__` at those rows. Every token's K/V is still written in the
        last layer too (later steps read it), and after the last layer's attention
        nothing mixes rows. So the last layer's attention output, output projection
        and MLP run for R rows instead of T, the work no sampled row needs.
        """
        states, kv_cache = self._trunk(input_ids, positions, kv_cache, md)
        x, kv_cache = self._layer(-1, states, positions, kv_cache, md, rows=rows)
        return self.norm(x), kv_cache, states

    def finish_states(self, states: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                      md: AttentionMetadata) -> jax.Array:
        """Every row's hidden state `[T, hidden]` from `forward_rows`' `states` and the
        cache it returned (the rare steps that score prompt tokens)."""
        x, _ = self._layer(-1, states, positions, kv_cache, md, write=False)
        return self.norm(x)

    def _trunk(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
               md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Embedding and every layer but the last."""
        if kv_cache.shape[0] % len(self.layers):
            raise ValueError(f"KV cache of {kv_cache.shape[0]} pages does not split into "
                             f"{len(self.layers)} layers")
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        for i in range(len(self.layers) - 1):
            x, kv_cache = self._layer(i, x, positions, kv_cache, md)
        return x, kv_cache

    def _layer(self, i: int, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
               md: AttentionMetadata, **kw: Any) -> tuple[jax.Array, jax.Array]:
        i %= len(self.layers)
        qk_norms = None if self.qk_norms is None else self.qk_norms[i]
        return self.layers[i](x, positions, kv_cache, md, self.layer_norms[i], qk_norms, **kw)

    @property
    def logits_head(self) -> nnx.Param:
        """The `[vocab, H]` matrix the logits come from (the embedding when tied)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @staticmethod
    def head_logits(head: jax.Array, hidden: jax.Array) -> jax.Array:
        """Float32 logits `[N, vocab]` (sharded over vocab on 'model') for hidden `[N, H]`.

        A function of the head matrix alone, so the runner's logits step takes
        one weight array rather than the whole model's."""
        return jnp.einsum("nh,vh->nv", hidden.astype(head.dtype), head,
                          preferred_element_type=jnp.float32)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return self.head_logits(self.logits_head[...], hidden)

    @staticmethod
    def hf_weight_map(hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """Where each parameter comes from in a Hugging Face checkpoint (used by the loader)."""
        return hf_weight_map(LlamaArch.from_hf_config(hf_config, tensor_parallel_size))

    @staticmethod
    def hf_ignored_tensor(hf_config: Any, name: str) -> bool:
        """Checkpoint tensors that are present but carry nothing this module needs."""
        if name.endswith("rotary_emb.inv_freq"):  # rope buffers saved by old exporters
            return True
        return name == "lm_head.weight" and bool(getattr(hf_config, "tie_word_embeddings", False))
