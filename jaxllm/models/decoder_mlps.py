"""The MLP each decoder layer picks, by its kind in `DecoderArch.mlp_kinds`: a dense
gated MLP, a non-gated one, or routed experts (with a shared expert where the family has one)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxllm.layers.gated_mlp import GatedMLP, PlainMLP
from jaxllm.layers.mlp import SwiGLU
from jaxllm.layers.moe import SparseMoE
from jaxllm.layers.moe_shared import SharedExpertMoE
from jaxllm.layers.quant import linear_method
from jaxllm.models.decoder_arch import DecoderArch


def dense_mlp(arch: DecoderArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
              swiglu: SwiGLU, mesh: Mesh | None) -> nnx.Module:
    return GatedMLP(arch.hidden_size, arch.intermediate_size, activation=arch.activation,
                    bias=arch.mlp_bias, dtype=dtype, rngs=rngs, swiglu=swiglu,
                    method=linear_method(arch.quantization))


def plain_mlp(arch: DecoderArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
              swiglu: SwiGLU, mesh: Mesh | None) -> nnx.Module:
    """The non-gated MLP (Arcee)."""
    return PlainMLP(arch.hidden_size, arch.intermediate_size, activation=arch.activation,
                    bias=arch.mlp_bias, dtype=dtype, rngs=rngs, swiglu=swiglu,
                    method=linear_method(arch.quantization))


def sparse_moe(arch: DecoderArch, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
               swiglu: SwiGLU, mesh: Mesh | None) -> nnx.Module:
    """The routed experts (models/moe.py), expert parallel over `mesh`."""
    moe = arch.moe
    routed = dict(num_experts=moe.num_experts, top_k=moe.top_k,
                  intermediate_size=moe.intermediate_size, hidden_size=arch.hidden_size,
                  renormalize=moe.renormalize, dtype=dtype, rngs=rngs, mesh=mesh,
                  method=linear_method(arch.quantization), grouped=moe.grouped,
                  biases=moe.biases, glu=moe.glu)
    if moe.shared_intermediate_size:
        return SharedExpertMoE(shared_intermediate_size=moe.shared_intermediate_size,
                               shared_gate=moe.shared_gate, swiglu=swiglu, **routed)
    return SparseMoE(**routed)


# Per-layer MLP kind (`DecoderArch.mlp_kinds`) -> its module. An MLP is called as
# `mlp(x, residual, num_tokens)` -> `residual + mlp(x)` (`mlp(x)` when residual is
# None), `num_tokens` the rows of `x` that are the step's tokens, the rest padding
# whose output nothing reads (the experts skip them; a dense MLP computes them);
# its checkpoint tensors are decoder_weights.MLP_WEIGHTS[kind]. `mesh`: the mesh the
# attention is split over (layers/attention_sharded.py; None on one device).
MLP_FACTORIES: dict[str, Callable[..., nnx.Module]] = {"dense": dense_mlp, "plain": plain_mlp,
                                                       "moe": sparse_moe}
