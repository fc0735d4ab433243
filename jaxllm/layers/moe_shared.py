"""Routed experts with a shared expert beside them (Qwen2-MoE): every token also runs one
dense gated MLP, whose output a sigmoid gate of the token scales before it joins the
routed experts' sum.

The routed half is `SparseMoE` unchanged (expert parallel, its small-step kernels and
partial-output sum); the shared expert is a `GatedMLP`, column/row parallel over
'model' like a dense layer's:

  weight                          shape           spec
  shared_expert.gate_up_proj      [2, I_s, hidden] (None, 'model', None)
  shared_expert.down_proj         [hidden, I_s]    (None, 'model')
  shared_expert_gate              [1, hidden]      replicated
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.layers.gated_mlp import GatedMLP
from jaxllm.layers.linear import make_param
from jaxllm.layers.mlp import SwiGLU
from jaxllm.layers.moe import SparseMoE


class SharedExpertMoE(SparseMoE):
    """`SparseMoE` plus a shared SwiGLU expert of `shared_intermediate_size`, gated per
    token by `sigmoid(x @ shared_expert_gate.T)` where `shared_gate`."""

    def __init__(self, *, shared_intermediate_size: int, shared_gate: bool, swiglu: SwiGLU,
                 **routed):
        super().__init__(**routed)
        h, dtype, rngs = routed["hidden_size"], routed["dtype"], routed["rngs"]
        self.shared_expert = GatedMLP(h, shared_intermediate_size, activation="silu",
                                      bias=False, dtype=dtype, rngs=rngs, swiglu=swiglu,
                                      method=routed.get("method"))
        self.shared_expert_gate = (make_param(rngs, (1, h), dtype, P(None, None))
                                   if shared_gate else None)

    def __call__(self, x: jax.Array, residual: jax.Array | None,
                 num_tokens: jax.Array | None = None) -> jax.Array:
        """`residual` plus the routed experts' and the gated shared expert's outputs (the
        two alone when `residual` is None)."""
        shared = self.shared_expert(x, None)
        if self.shared_expert_gate is not None:
            gate = jnp.einsum("th,oh->to", x, self.shared_expert_gate[...],
                              preferred_element_type=jnp.float32)
            shared = (jax.nn.sigmoid(gate.astype(x.dtype)) * shared).astype(x.dtype)
        out = super().__call__(x, None, num_tokens) + shared
        return out if residual is None else residual + out
