"""The sparse mixture-of-experts MLP: a router picks `top_k` of `num_experts` SwiGLU
experts per token and the layer returns their outputs' weighted sum.

Routing (`route`): softmax over all experts' logits in float32, the `top_k`
largest, renormalized to sum to one when `renormalize` (Mixtral always; that
equals a softmax over the top-k logits; Qwen3-MoE iff `norm_topk_prob`).

The experts run as two grouped matmuls over the T*k (token, expert) pairs
sorted by expert (`expert_ffn`): gather each pair's token row, gate/up for each
expert's run of rows, SiLU·mul, down, scale by the routing weight, then scatter-add
back to the token. Shapes are fixed (T*k rows whatever the routing), so the step
stays one compiled program; padding tokens are routed like any other and their
rows dropped by the caller. The grouped matmul is layers/grouped_matmul.py's.

Weights keep Hugging Face's `[out, in]` orientation, stacked per expert:

  weight             shape             spec                          role
  router             [E, hidden]       replicated                    every device routes every token
  gate_up_proj       [E, 2, I, hidden] ('model', None, None, None)  expert parallel
  down_proj          [E, hidden, I]    ('model', None, None)         expert parallel
  gate_up_proj_scale [E, 2, I]         ('model', None, None)         quantized experts only
  down_proj_scale    [E, hidden]       ('model', None)               quantized experts only
  *_input_scale      []                replicated                    static fp8 only

Quantized (`method`, layers/quant.py: `--quantization int8|fp8`), the experts'
weights are int8 / float8_e4m3fn with one float32 scale per expert and output
channel, and the router stays float (as vLLM keeps it).

Expert parallelism: over several 'model' devices each holds E / tp whole experts.
The pallas_call cannot be partitioned by XLA, and ragged_dot over sharded groups
is not either, so the experts run under `shard_map`: tokens and routing
replicated, each device computing the pairs routed to its own experts (the rest
masked out) and a psum over 'model' adding the partial outputs, the same one
all-reduce per layer a row-parallel dense MLP costs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError
from jaxllm.layers.grouped_matmul import GroupedMatmul, default_grouped_matmul
from jaxllm.layers.linear import make_param
from jaxllm.layers.quant import quantize_traced

_shard_map = getattr(jax, "shard_map", None)
if _shard_map is None:  # jax < 0.7
    from jax.experimental.shard_map import shard_map as _shard_map


def route(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights `[T, k]` float32, expert ids `[T, k]` int32) for router logits `[T, E]`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def expert_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array,
               down: jax.Array, gmm: GroupedMatmul, first_expert: jax.Array | int = 0,
               method: Any = None, gate_up_scale: jax.Array | None = None,
               down_scale: jax.Array | None = None,
               input_scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`sum_j weights[t, j] * expert_{ids[t, j]}(x[t])` over the experts this call holds,
    `[T, hidden]` in float32 (partial sums over devices add up before the cast).

    `gate_up [E_l, 2, I, H]` and `down [E_l, H, I]` are experts `first_expert ...
    first_expert + E_l - 1`; pairs routed to any other expert contribute zero (another
    device holds it). One argsort of the T*k pairs by local expert puts the pairs this
    call skips last, outside every group. `method` (quantized weights): layers/quant.py's,
    with the per-expert channel scales `gate_up_scale [E_l, 2, I]`, `down_scale [E_l, H]`
    (and, static fp8, the two products' activation scales `input_scales`).
    """
    t, k = ids.shape
    local, inter, hidden = gate_up.shape[0], gate_up.shape[2], gate_up.shape[3]
    expert = ids.reshape(-1) - first_expert
    mine = (expert >= 0) & (expert < local)
    key = jnp.where(mine, expert, local)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(local + 1, jnp.int32).at[key].add(1)[:local]
    token = order // k
    row_expert = jnp.minimum(key[order], local - 1)  # skipped pairs: any expert, masked

    statics = input_scales or (None, None)

    def product(lhs: jax.Array, w: jax.Array, scale: jax.Array | None, i: int) -> jax.Array:
        if method is None:
            return gmm(lhs, w, sizes)
        return method.grouped(gmm, lhs, w, scale, sizes, row_expert, statics[i]
                              ).astype(x.dtype)

    h = product(x[token], gate_up.reshape(local, 2 * inter, hidden),
                None if gate_up_scale is None else gate_up_scale.reshape(local, 2 * inter), 0)
    h = jax.nn.silu(h[:, :inter]) * h[:, inter:]
    y = product(h, down, down_scale, 1)
    scale = jnp.where(mine[order], weights.reshape(-1)[order], 0.0)
    # where, not a product: the kernel leaves the skipped pairs' rows unwritten (maybe NaN).
    y = jnp.where(mine[order][:, None], y.astype(jnp.float32) * scale[:, None], 0.0)
    return jnp.zeros((t, hidden), jnp.float32).at[token].add(y)


class SparseMoE(nnx.Module):
    """The routed experts of one layer; `mesh` (several 'model' devices) makes them
    expert parallel."""

    def __init__(self, *, num_experts: int, top_k: int, intermediate_size: int,
                 hidden_size: int, renormalize: bool, dtype: jnp.dtype, rngs: nnx.Rngs,
                 gmm: GroupedMatmul | None = None, mesh: Mesh | None = None,
                 method: Any = None):
        e, i, h = num_experts, intermediate_size, hidden_size
        if not 1 <= top_k <= e:
            raise ParameterError("config.json:num_experts_per_tok",
                                 f"must be in [1, {e}] (the number of experts), got {top_k}")
        self.gmm = gmm or default_grouped_matmul(mesh)
        self.mesh = mesh if mesh is not None and mesh.shape["model"] > 1 else None
        if self.mesh is not None and e % self.mesh.shape["model"]:
            raise ParameterError("tensor_parallel_size", f"{self.mesh.shape['model']} does not "
                                 f"divide the {e} experts (each device holds whole experts)")
        self.top_k, self.renormalize = top_k, renormalize
        self.router = make_param(rngs, (e, h), dtype, P(None, None))
        self.method = method
        self.gate_up_proj, self.gate_up_proj_scale = _experts(rngs, (e, 2, i, h), dtype, method)
        self.down_proj, self.down_proj_scale = _experts(rngs, (e, h, i), dtype, method)
        # Static fp8: one activation scale per product, the largest of every expert's
        # (vLLM's choice), replicated.
        static = getattr(method, "static", False)
        self.gate_up_proj_input_scale, self.down_proj_input_scale = (
            (make_param(rngs, (), jnp.float32, P(), "ones"),
             make_param(rngs, (), jnp.float32, P(), "ones")) if static else (None, None))

    def __call__(self, x: jax.Array, residual: jax.Array | None) -> jax.Array:
        """`residual` plus the experts' weighted output for the normed input `x` (the
        output alone when `residual` is None), as the decoder calls every MLP."""
        logits = jnp.einsum("th,eh->te", x, self.router[...],
                            preferred_element_type=jnp.float32)
        weights, ids = route(logits, self.top_k, self.renormalize)
        experts = (self.gate_up_proj[...], self.down_proj[...])
        if self.method is not None:
            experts += (self.gate_up_proj_scale[...], self.down_proj_scale[...])
        statics = (() if self.gate_up_proj_input_scale is None else
                   (self.gate_up_proj_input_scale[...], self.down_proj_input_scale[...]))

        def ffn(x, weights, ids, statics, *experts, first=0):
            return expert_ffn(x, weights, ids, *experts[:2], self.gmm, first, self.method,
                              *experts[2:], input_scales=statics or None)

        if self.mesh is None:
            out = ffn(x, weights, ids, statics, *experts)
        else:
            def shard(x, weights, ids, statics, *experts):
                first = jax.lax.axis_index("model") * experts[0].shape[0]
                return jax.lax.psum(ffn(x, weights, ids, statics, *experts, first=first),
                                    "model")

            out = _shard_map(shard, mesh=self.mesh,
                             in_specs=(P(), P(), P(), P()) + (P("model"),) * len(experts),
                             out_specs=P(), check_vma=False)(x, weights, ids, statics, *experts)
        out = out.astype(x.dtype)
        return out if residual is None else residual + out


def _experts(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, method: Any
             ) -> tuple[nnx.Param, nnx.Param | None]:
    """Stacked expert weights `shape` `[E, *out, in]`, expert parallel, and their
    per-expert channel scales `[E, *out]` when `method` quantizes them (dummy weights:
    random ones quantized)."""
    spec = P("model", *([None] * (len(shape) - 1)))
    if method is None:
        return make_param(rngs, shape, dtype, spec), None
    q, scale = quantize_traced(method, make_param(rngs, shape, jnp.float32, spec)[...], 1)
    return (nnx.Param(q, out_sharding=spec, eager_sharding=False),
            nnx.Param(scale, out_sharding=P(*spec[:-1]), eager_sharding=False))
