"""The EAGLE / EAGLE-3 draft head: one Llama decoder layer over the target's hidden states,
built from the generic decoder's attention and MLP (models/eagle_config.py describes
both layouts).

`EagleHead(embeds, hidden, positions, kv_cache, md)` returns the hidden state the
next draft step takes, the one its logits come from, and the head's KV cache
(one layer). EAGLE: h = fc(concat(embeds, hidden)); the layer runs without an
input norm and its output is both. EAGLE-3: the layer attends over
concat(input_layernorm(embeds), hidden_norm(hidden)) with `hidden` as the
residual; its pre-norm output feeds the next step and `norm` of it gives the
logits, over the draft vocabulary mapped to target ids by `d2t`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.distributed.mesh import variable_sharding
from jaxllm.errors import ParameterError
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.layers.attention_sharded import shard_attention
from jaxllm.layers.gated_mlp import GatedMLP
from jaxllm.layers.linear import Linear, make_param
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.precision import at_model_precision
from jaxllm.models.decoder_attention import DecoderAttention
from jaxllm.models.decoder_weights import hf_weight_map
from jaxllm.models.eagle_config import FIELD, EagleHeadSpec, canonical
from jaxllm.models.llama import llama_arch
from jaxllm.models.safetensors_files import SafetensorsCheckpoint

# The head's RMSNorm weights, stacked in this order.
NORMS = {"eagle": ("layers.0.post_attention_layernorm",),
         "eagle3": ("layers.0.input_layernorm", "layers.0.hidden_norm",
                    "layers.0.post_attention_layernorm", "norm")}


class EagleHead(nnx.Module):
    def __init__(self, spec: EagleHeadSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 attn_backend: Any, swiglu: Any, tensor_parallel_size: int = 1):
        # Split like the target's layers: q / kv heads and the MLP's intermediate over
        # 'model' (kv heads copied where fewer than devices), `fc` replicated (small,
        # and its output is the replicated residual stream), vocab-parallel tables.
        arch = llama_arch(spec.hf_config, tensor_parallel_size)
        h = arch.hidden_size
        self.dtype = jnp.dtype(dtype)
        self.eagle3 = spec.eagle3
        self.eps = arch.rms_norm_eps
        self.norm_before_residual = spec.norm_before_residual
        self.fc = Linear((h,), (spec.fc_in,), P(None, None), dtype=dtype, rngs=rngs,
                         bias=spec.fc_bias)
        self.self_attn = DecoderAttention(arch, 0, dtype=dtype, rngs=rngs,
                                          attn_backend=attn_backend, swiglu=swiglu)
        if spec.eagle3:  # its attention reads embeddings and hidden states side by side
            kv, g, d = arch.num_kv_heads, arch.group, arch.head_dim
            self.self_attn.qkv_proj = Linear((kv, g + 2, d), (2 * h,),
                                             P("model", None, None, None), dtype=dtype,
                                             rngs=rngs, bias=arch.qkv_bias)
        self.mlp = GatedMLP(h, arch.intermediate_size, activation="silu", bias=arch.mlp_bias,
                            dtype=dtype, rngs=rngs, swiglu=swiglu)
        self.norms = make_param(rngs, (len(NORMS[spec.method]), h), dtype, P(None, None), "ones")
        self.embed_tokens = (make_param(rngs, (arch.vocab_size, h), dtype, P("model", None))
                             if spec.own_embed else None)
        self.lm_head = (make_param(rngs, (spec.draft_vocab_size, h), dtype, P("model", None))
                        if spec.eagle3 else None)
        self.d2t = (nnx.Param(jnp.zeros(spec.draft_vocab_size, jnp.int32))
                    if spec.eagle3 else None)

    @at_model_precision
    def __call__(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array,
                 kv_cache: jax.Array, md: AttentionMetadata
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(next step's hidden, the logits' hidden, kv_cache) for `[T, H]` inputs."""
        n = self.norms[...]
        if not self.eagle3:
            x = self.fc(jnp.concatenate([embeds, hidden.astype(embeds.dtype)], axis=-1))
            x, kv_cache = self.self_attn(x, positions, kv_cache, md, None, residual=x)
            out = self.mlp(rms_norm(x, n[0], self.eps), x)
            return out, out, kv_cache
        hidden = hidden.astype(embeds.dtype)
        normed = rms_norm(hidden, n[1], self.eps)
        x = jnp.concatenate([rms_norm(embeds, n[0], self.eps), normed], axis=-1)
        residual = normed if self.norm_before_residual else hidden
        x, kv_cache = self.self_attn(x, positions, kv_cache, md, None, residual=residual)
        pre = self.mlp(rms_norm(x, n[2], self.eps), x)
        return pre, rms_norm(pre, n[3], self.eps), kv_cache

    @at_model_precision
    def combine(self, aux: jax.Array) -> jax.Array:
        """EAGLE-3's fc over the target's concatenated aux hidden states (EAGLE: as is)."""
        return self.fc(aux) if self.eagle3 else aux

    @at_model_precision
    def greedy(self, hidden: jax.Array, target_head: jax.Array, head_logits: Any) -> jax.Array:
        """The argmax target token ids of the logits' hidden states `hidden`."""
        if not self.eagle3:  # the target's logits head
            return jnp.argmax(head_logits(target_head, hidden), axis=-1).astype(jnp.int32)
        logits = jnp.einsum("nh,vh->nv", hidden, self.lm_head[...],
                            preferred_element_type=jnp.float32)
        d = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return d + self.d2t[...][d]


def _host_values(spec: EagleHeadSpec, tensor_parallel_size: int) -> dict[tuple, np.ndarray]:
    """Every parameter's value, by its path in the head's state, from the checkpoint
    (kv heads copied for `tensor_parallel_size` as the target's)."""
    ckpt = SafetensorsCheckpoint(spec.model_dir)

    def read(name: str) -> np.ndarray:
        return np.asarray(ckpt.read(spec.names[name]))

    values = {}
    for src in hf_weight_map(llama_arch(spec.hf_config, tensor_parallel_size)):
        if src.path[:2] == ("layers", 0) and src.path[2] in ("self_attn", "mlp"):
            values[src.path[2:]] = src.combine([read(canonical(t)) for t in src.tensors])
    values[("fc", "weight")] = read("fc.weight")
    if spec.fc_bias:
        values[("fc", "bias")] = read("fc.bias")
    values[("norms",)] = np.stack([read(f"{n}.weight") for n in NORMS[spec.method]])
    if spec.own_embed:
        values[("embed_tokens",)] = read("embed_tokens.weight")
    if spec.eagle3:
        values[("lm_head",)] = read("lm_head.weight")
        values[("d2t",)] = (read("d2t").astype(np.int32) if "d2t" in spec.names
                            else np.zeros(spec.draft_vocab_size, np.int32))
    return values


def load_eagle_head(spec: EagleHeadSpec, mesh: Mesh, attn_backend: Any, swiglu: Any,
                    dtype: Any) -> EagleHead:
    """The head of `spec` in `dtype`, each weight placed on `mesh` as it declares; over
    several devices its attention runs per shard (`shard_attention`), as the target's."""
    tp = mesh.shape["model"]
    head = EagleHead(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0),
                     attn_backend=shard_attention(attn_backend, mesh), swiglu=swiglu,
                     tensor_parallel_size=tp)
    variables = dict(nnx.to_flat_state(nnx.state(head)))
    for path, host in _host_values(spec, tp).items():
        var = variables[path]
        want = var.get_value()
        if tuple(host.shape) != tuple(want.shape):
            raise ParameterError(FIELD, f"head tensor(s) for {'.'.join(map(str, path))} have "
                                 f"shape {tuple(host.shape)}, but its config implies "
                                 f"{tuple(want.shape)}")
        var.set_value(jax.device_put(host.astype(want.dtype), variable_sharding(var, mesh)))
    return head
