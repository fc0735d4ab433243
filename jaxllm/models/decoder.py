"""The generic decoder: one forward, `forward_rows` and `finish_states` for every family.

A family (models/llama.py, models/gemma.py) only reads its Hugging Face config
into a `DecoderArch` (models/decoder_arch.py); this module builds the layers
from it and implements the model contract (models/contract.py). What differs
between families is configuration: biases, q/k norms, the MLP each layer picks
(models/decoder_mlps.py), per-layer sliding windows and ropes, two norms per layer or
four (Gemma's norms on the attention's and MLP's outputs), Gemma's `1 + w`
norms, scaled embedding, attention and final logit soft-caps and attention
scale. Weights keep Hugging Face's `[out, in]` orientation, so loading is
reshape/stack, never a transpose; projections are fused so a layer runs one
qkv and one gate/up matmul.

Every weight declares its sharding over the mesh axis 'model':

  weight          shape                      spec                     role
  embed_tokens    [vocab, hidden]            ('model', None)          vocab-parallel
  lm_head         [vocab, hidden]            ('model', None)          vocab-parallel logits
  qkv_proj        [kv_heads, G+2, D, hidden] ('model', ...)           column-parallel
  qkv_proj bias   [kv_heads, G+2, D]         ('model', ...)
  o_proj          [hidden, heads, D]         (None, 'model', None)    row-parallel
  gate_up_proj    [2, inter, hidden]         (None, 'model', None)    column-parallel
  down_proj       [hidden, inter]            (None, 'model')          row-parallel
  norms, biases of row-parallel outputs      replicated
  qk_norms (OLMo 2) [layers, kv_heads, G+1, D] (None, 'model', ...)    with qkv's heads
  attn_sinks      [layers, heads]            replicated

A "moe" layer's router and experts (Mixtral, Qwen3-MoE, GPT-OSS): layers/moe.py's table,
each device holding whole experts. DeepSeek's latent attention (MLA) in place of qkv_proj
and o_proj: models/mla.py's table.

G = heads // kv_heads. The fused qkv weight groups, per kv head, its G query
heads then its k head then its v head, so sharding the kv-head axis gives every
'model' shard whole q, k and v heads that attend to each other (GQA stays local).
With fewer kv heads than 'model' shards (tensor_parallel_size), each kv head is
replicated tp / kv_heads times and its query heads dealt among the copies, so
`kv_heads` above is then tp and every shard holds one kv head (as vLLM does).
Tied embeddings reuse `embed_tokens` for the logits. Every layer's norm weights sit
in one stacked array (`layer_norms`, `qk_norms`), GPT-OSS's attention sink logits in
another (`attn_sinks [layers, heads]` float32, replicated; the sharded attention hands
each device its query heads' entries): a step pays the host per array.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.layers import row_reduce
from jaxllm.layers.attention import AttentionBackend, AttentionMetadata
from jaxllm.layers.linear import make_param
from jaxllm.layers.mlp import SwiGLU
from jaxllm.layers.moe import SparseMoE
from jaxllm.layers.moe_shared import SharedExpertMoE
from jaxllm.layers.norm import RMSNorm, layer_norm, rms_norm
from jaxllm.layers.precision import at_model_precision
from jaxllm.models.contract import KVCacheSpec, LogitsHead, WeightSource
from jaxllm.models.decoder_arch import DecoderArch, with_context
from jaxllm.models.decoder_attention import DecoderAttention
from jaxllm.models.decoder_mlps import MLP_FACTORIES
from jaxllm.models.decoder_weights import hf_weight_map
from jaxllm.models.mla import MLAAttention


class DecoderLayer(nnx.Module):
    def __init__(self, arch: DecoderArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: AttentionBackend, swiglu: SwiGLU):
        attention = DecoderAttention if arch.mla is None else MLAAttention
        self.self_attn = attention(arch, layer, dtype=dtype, rngs=rngs,
                                   attn_backend=attn_backend, swiglu=swiglu)
        self.mlp = MLP_FACTORIES[arch.mlp_kinds[layer]](
            arch, layer, dtype=dtype, rngs=rngs, swiglu=swiglu,
            mesh=getattr(attn_backend, "mesh", None))
        self.eps, self.offset, self.sandwich = (arch.rms_norm_eps, arch.norm_offset,
                                                arch.sandwich_norms)
        self.post_norms, self.parallel = arch.post_norms, arch.parallel_block
        self.num_norms = len(arch.norm_names)

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata, norms: jax.Array, qk_norms: jax.Array | None,
                 rows: jax.Array | None = None, write: bool = True,
                 kv_scale: jax.Array | None = None, normed: jax.Array | None = None,
                 next_norm: row_reduce.NormWeight | None = None,
                 sinks: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """The layer's output, that output under the norm `next_norm` (the next layer's
        input norm or the final one; None where not given), and the updated cache.

        `norms`: every layer's RMSNorm weights `[L * (2 or 4), hidden]`
        (`norm_names` order); `qk_norms`: every layer's q/k norm weights
        `[L, 2, D]` (per head) or `[L, KV, G + 1, D]` (`whole_qk_norm`); `rows`, `write`,
        `sinks` (this layer's): as in `DecoderAttention` (the output has `rows`' rows);
        `normed`: `x` under this layer's input norm, where the layer before gave it. A
        norm after a row-parallel sum runs with it (`Linear.add_norm`: one kernel under
        tensor parallelism), so a layer norms the next one's input."""
        first = self.self_attn.layer * self.num_norms

        def normed_by(y: jax.Array, weight: jax.Array) -> jax.Array:
            if self.parallel:
                return layer_norm(y, weight, self.eps)
            return rms_norm(y, weight, self.eps, self.offset)

        def norm(y: jax.Array, i: int) -> jax.Array:
            return normed_by(y, norms[first + i])

        def after(y: jax.Array) -> jax.Array | None:
            return None if next_norm is None else normed_by(y, next_norm.weight)

        # The real rows lead: the step's tokens, or with `rows` one per real request.
        num_tokens = md.cu_q_lens[-1] if rows is None else md.num_seqs[0]
        attn = self.self_attn
        if self.parallel:  # Cohere: attention and MLP side by side on the one norm
            h = norm(x, 0) if normed is None else normed
            o, residual, kv_cache = attn.heads(h, positions, kv_cache, md, qk_norms, x,
                                               rows=rows, write=write, kv_scale=kv_scale,
                                               sinks=sinks)
            mlp_in = h if rows is None else h[rows]
            x = residual + attn.o_proj(o) + self.mlp(mlp_in, None, num_tokens)
            return x, after(x), kv_cache
        if self.post_norms:  # OLMo 2: the attention and the MLP read the residual stream
            x, kv_cache = attn(x, positions, kv_cache, md, qk_norms, residual=x,
                               post_norm=norms[first], rows=rows, write=write,
                               kv_scale=kv_scale, sinks=sinks)
            x = x + norm(self.mlp(x, None, num_tokens), 1)
            return x, after(x), kv_cache
        h = norm(x, 0) if normed is None else normed
        if self.sandwich:
            x, kv_cache = attn(h, positions, kv_cache, md, qk_norms, residual=x,
                               post_norm=norms[first + 1], rows=rows, write=write,
                               kv_scale=kv_scale, sinks=sinks)
            x = x + norm(self.mlp(norm(x, 2), None, num_tokens), 3)
            return x, after(x), kv_cache
        o, residual, kv_cache = attn.heads(h, positions, kv_cache, md, qk_norms, x, rows=rows,
                                           write=write, kv_scale=kv_scale, sinks=sinks)
        x, h = attn.o_proj.add_norm(o, residual, row_reduce.NormWeight(norms, first + 1), self.eps,
                                    self.offset)
        if next_norm is None:
            return self.mlp(h, x, num_tokens), None, kv_cache
        x, h = self.mlp.add_norm(h, x, num_tokens, next_norm, self.eps, self.offset)
        return x, h, kv_cache


class DecoderForCausalLM(nnx.Module):
    """A decoder-only causal LM over a ragged, paged batch; a family subclass sets
    `arch_from_hf_config` (its config reader)."""

    @staticmethod
    def arch_from_hf_config(hf_config: Any, tensor_parallel_size: int = 1) -> DecoderArch:
        raise NotImplementedError

    def __init__(self, hf_config: Any, *, dtype: str | jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: AttentionBackend, swiglu: SwiGLU | None = None,
                 tensor_parallel_size: int = 1, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", max_model_len: int | None = None):
        arch = with_context(self.arch_from_hf_config(hf_config, tensor_parallel_size),
                            hf_config, max_model_len)
        if quantization is not None:  # every attention and MLP projection, experts too
            arch = dataclasses.replace(arch, quantization=quantization)
        swiglu = swiglu or SwiGLU()
        dtype = jnp.dtype(dtype)
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = make_param(rngs, (arch.vocab_size, arch.hidden_size), dtype,
                                       P("model", None))
        self.layers = nnx.List([
            DecoderLayer(arch, i, dtype=dtype, rngs=rngs, attn_backend=attn_backend,
                         swiglu=swiglu)
            for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps, dtype=dtype,
                            offset=arch.norm_offset)
        norm_init = "zeros" if arch.norm_offset else "ones"  # identity norms for dummy weights
        self.layer_norms = make_param(
            rngs, (arch.num_layers, len(arch.norm_names), arch.hidden_size), dtype,
            P(None, None, None), norm_init)
        if arch.qk_norm_whole:  # `[L, KV, G + 1, D]`: the fused layout's q heads and k head
            self.qk_norms = make_param(
                rngs, (arch.num_layers, arch.num_kv_heads, arch.group + 1, arch.head_dim), dtype,
                P(None, "model", None, None), norm_init)
        else:
            self.qk_norms = (make_param(rngs, (arch.num_layers, 2, arch.head_dim), dtype,
                                        P(None, None, None), norm_init) if arch.qk_norm else None)
        self.lm_head = (None if arch.tie_word_embeddings else
                        make_param(rngs, (arch.vocab_size, arch.hidden_size), dtype,
                                   P("model", None)))
        self.head_logits = LogitsHead(arch.final_soft_cap, arch.logits_scale)
        # The vocab-parallel lookup's sum for small steps (attach_row_reduce); None: XLA's.
        self.embed_reduce: nnx.Module | None = nnx.data(None)
        # GPT-OSS's sink logits, every layer's in one array (a step pays the host per array).
        self.attn_sinks = (make_param(rngs, (arch.num_layers, arch.num_heads), jnp.float32,
                                      P(None, None), "zeros") if arch.attn_sinks else None)
        # An fp8 KV cache's per-layer K and V scales (the checkpoint's, else 1.0 as vLLM).
        self.kv_scales = (make_param(rngs, (arch.num_layers, 2), jnp.float32, P(None, None),
                                     "ones") if kv_cache_dtype != "auto" else None)

    @at_model_precision
    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Hidden states after the final norm `[T, hidden]` and the updated KV cache.

        `kv_cache` holds the pages of every layer, `num_layers` equal runs along
        axis 0 (see jaxllm/layers/attention.py).
        """
        states, normed, kv_cache = self._trunk(input_ids, positions, kv_cache, md)
        return self._last(states, normed, positions, kv_cache, md)

    @at_model_precision
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
        states, normed, kv_cache = self._trunk(input_ids, positions, kv_cache, md)
        y, kv_cache = self._last(states, normed, positions, kv_cache, md, rows=rows)
        return y, kv_cache, states

    @at_model_precision
    def finish_states(self, states: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                      md: AttentionMetadata) -> jax.Array:
        """Every row's hidden state `[T, hidden]` from `forward_rows`' `states` and the
        cache it returned (the rare steps that score prompt tokens)."""
        return self._last(states, None, positions, kv_cache, md, write=False)[0]

    @at_model_precision
    def forward_captured(self, input_ids: jax.Array, positions: jax.Array,
                         kv_cache: jax.Array, md: AttentionMetadata, rows: jax.Array,
                         layers: tuple[int, ...], on_rows: bool
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """`forward_rows`' outputs (`on_rows`; else `__call__`'s, the states final) and
        what an EAGLE head reads of every row: the final hidden states (`layers` empty;
        never `on_rows`) or the residual streams entering `layers`, concatenated in
        ascending layer order `[T, len(layers) * hidden]`."""
        aux: list[jax.Array] = []
        x, normed, kv_cache = self._trunk(input_ids, positions, kv_cache, md, layers, aux)
        if len(self.layers) - 1 in layers:
            aux.append(x)
        # What the head reads sits whole on every device, as the residual stream does
        # (pinned: the head's programs take it as placed here, with no reshard).
        mesh = getattr(self.layers[0].self_attn.attn_backend, "mesh", None)

        def whole(v: jax.Array) -> jax.Array:
            return v if mesh is None else jax.lax.with_sharding_constraint(
                v, NamedSharding(mesh, P()))

        if on_rows:
            last, kv_cache = self._last(x, normed, positions, kv_cache, md, rows=rows)
            return last, kv_cache, x, whole(jnp.concatenate(aux, axis=-1))
        y, kv_cache = self._last(x, normed, positions, kv_cache, md)
        return y[rows], kv_cache, y, whole(jnp.concatenate(aux, axis=-1) if layers else y)

    def _trunk(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
               md: AttentionMetadata, capture: tuple[int, ...] = (),
               aux: list | None = None) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """Embedding and every layer but the last (the input of each layer in `capture`
        appended to `aux`): the last layer's input, that under its input norm (None for
        a one-layer model), and the cache."""
        # Grouped metadata: pages for each slot of a group (jaxllm/kv_groups.py).
        runs = self.layers[0].self_attn.pages_per_block if md.grouped else len(self.layers)
        if kv_cache.shape[0] % runs:
            raise ValueError(f"KV cache of {kv_cache.shape[0]} pages does not split into "
                             f"{runs} runs of pages")
        table = self.embed_tokens[...]
        x = row_reduce.embedding_lookup(self.embed_reduce, table, input_ids)
        if x is None:
            x = jnp.take(table, input_ids, axis=0)
        if self.arch.embed_scale:  # in the model dtype, as Hugging Face rounds it
            x = x * jnp.asarray(self.arch.hidden_size ** 0.5, x.dtype)
        normed, norms, per_layer = None, self._norms(), len(self.arch.norm_names)
        for i in range(len(self.layers) - 1):
            if i in capture:
                aux.append(x)
            # With norms after attention and MLP only, no layer norms its input.
            next_norm = (None if self.arch.post_norms
                         else row_reduce.NormWeight(norms, (i + 1) * per_layer))
            x, normed, kv_cache = self._layer(i, x, positions, kv_cache, md, normed=normed,
                                              next_norm=next_norm)
        return x, normed, kv_cache

    def _last(self, x: jax.Array, normed: jax.Array | None, positions: jax.Array,
              kv_cache: jax.Array, md: AttentionMetadata, **kw: Any) -> tuple[jax.Array, ...]:
        """The last layer for its input `x` (`normed`: under its input norm, or None):
        its output under the final norm, and the updated cache."""
        _, y, kv_cache = self._layer(-1, x, positions, kv_cache, md, normed=normed, next_norm=(
            row_reduce.NormWeight(self.norm.weight[...][None], 0)), **kw)
        return y, kv_cache

    def _norms(self) -> jax.Array:  # every layer's RMSNorm weights `[L * (2 or 4), hidden]`
        return self.layer_norms[...].reshape(-1, self.arch.hidden_size)

    def _layer(self, i: int, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
               md: AttentionMetadata, **kw: Any) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        i %= len(self.layers)
        qk_norms = None if self.qk_norms is None else self.qk_norms[...]  # the stack, read by layer
        if self.kv_scales is not None:
            kw["kv_scale"] = self.kv_scales[i]
        if self.attn_sinks is not None:
            kw["sinks"] = self.attn_sinks[i]
        return self.layers[i](x, positions, kv_cache, md, self._norms(), qk_norms, **kw)

    def attach_row_reduce(self, reduce: nnx.Module) -> None:
        """Gives every row-parallel product (each layer's output projection, a dense
        MLP's down projection, a mixture of experts' partial outputs) the shared
        `reduce` that sums their shards for small steps (layers/row_reduce.py), and
        the embedding's lookup."""
        self.embed_reduce = reduce
        for layer in self.layers:
            layer.self_attn.o_proj.reduce = reduce
            if isinstance(layer.mlp, SharedExpertMoE):
                layer.mlp.shared_expert.down_proj.reduce = reduce
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.reduce = reduce
            else:
                layer.mlp.down_proj.reduce = reduce

    @property
    def logits_head(self) -> nnx.Param:
        """The `[vocab, H]` matrix the logits come from (the embedding when tied)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return self.head_logits(self.logits_head[...], hidden)

    @classmethod
    def hf_weight_map(cls, hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """Where each parameter comes from in a Hugging Face checkpoint (used by the loader)."""
        return hf_weight_map(cls.arch_from_hf_config(hf_config, tensor_parallel_size))

    @classmethod
    def hf_ignored_tensor(cls, hf_config: Any, name: str) -> bool:
        """Checkpoint tensors that are present but carry nothing this module needs."""
        if name.endswith("rotary_emb.inv_freq"):  # rope buffers saved by old exporters
            return True
        return name == "lm_head.weight" and bool(getattr(hf_config, "tie_word_embeddings", False))

    @classmethod
    def kv_cache_spec(cls, hf_config: Any, tensor_parallel_size: int = 1) -> KVCacheSpec:
        arch = cls.arch_from_hf_config(hf_config, tensor_parallel_size)
        return KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim)
