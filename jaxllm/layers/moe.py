"""The sparse mixture-of-experts MLP: a router picks `top_k` of `num_experts` SwiGLU
experts per token and the layer returns their outputs' weighted sum.

Routing (layers/moe_routing.py): the softmax top-k (`route`), or grouped sigmoid
scores with a correction bias (`grouped_route`, GLM-4.5).

The experts run as two grouped matmuls over the T*k (token, expert) pairs
sorted by expert (`expert_ffn`): gather each pair's token row, gate/up for each
expert's run of rows, the activation (SiLU·mul; GPT-OSS's clamped form and biases,
layers/moe_glu.py), down, scale by the routing weight, then scatter-add back to the
token. Shapes are fixed (T*k rows whatever the routing), so the step
stays one compiled program. The grouped matmul is layers/grouped_matmul.py's.

Small steps (decode) take `routed_expert_ffn` instead, chosen at trace time when
the step has at most `small_token_limit()` token rows (SMALL_TOKENS, or
`JAXLLM_MOE_SMALL_TOKENS`; 0 on TPU): a `fori_loop` whose trip count is the
number of distinct experts the step's real tokens routed to, each iteration
reading one expert's weights (a dynamic index) and applying them to every row,
kept where routed. The GPU's grouped-matmul bodies read far more at a decode step
(ragged_dot computes every expert; "tiled" gathers one expert per tile of its
static bound). Both paths route padding tokens nowhere: the caller passes the
step's real token count (`num_tokens`, the rows before it), and the padding rows
come back zero.

On the GPU a small step of unquantized experts runs `routed_expert_kernel` instead
(`small_step_kernel`: `JAXLLM_MOE_SMALL_KERNEL=loop|pallas`, pallas on GPU, loop
elsewhere): the loop's iterations each pay a launch and a copy of the dynamically
indexed expert, while pallas_kernels/moe_small's two kernels (gate/up per (routed
slot, column block), down per column block over the slots) read every routed expert's
weights in place, once, with no host-side loop. `routed_slots` (layers/moe_routing.py)
turns the routing into their inputs. Quantized experts, and sizes off its 16-wide
tiles, keep the loop; the loop stays the oracle on the CPU, where "pallas" runs the
kernels in Pallas interpret mode (tests). The layer hands them the router logits
(`routed_logits_kernel`): a third kernel does `route` and `routed_slots`' work in one
program, which on the GPU otherwise takes a dozen-odd small XLA kernels (sorts among
them) per layer; `routed_expert_kernel` keeps the jnp routing (the kernels' oracle).

Weights keep Hugging Face's `[out, in]` orientation, stacked per expert:

  weight             shape             spec                          role
  router             [E, hidden]       replicated                    every device routes every token
  gate_up_proj       [E, 2, I, hidden] ('model', None, None, None)  expert parallel
  down_proj          [E, hidden, I]    ('model', None, None)         expert parallel
  gate_up_proj_scale [E, 2, I]         ('model', None, None)         quantized experts only
  down_proj_scale    [E, hidden]       ('model', None)               quantized experts only
  *_input_scale      []                replicated                    static fp8 only
  router_bias        [E]               replicated                    GPT-OSS only
  gate_up_proj_bias  [E, 2, I]         ('model', None, None)         GPT-OSS only
  down_proj_bias     [E, hidden]       ('model', None)               GPT-OSS only

Quantized (`method`, layers/quant.py: `--quantization int8|fp8`), the experts'
weights are int8 / float8_e4m3fn with one float32 scale per expert and output
channel, and the router stays float (as vLLM keeps it).

Expert parallelism: over several 'model' devices each holds E / tp whole experts.
The pallas_calls cannot be partitioned by XLA, and ragged_dot over sharded groups
is not either, so the experts run under `shard_map`: tokens and routing
replicated, each device computing the pairs routed to its own experts (the rest
masked out) and a psum over 'model' adding the partial outputs, the same one
all-reduce per layer a row-parallel dense MLP costs.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError
from jaxllm.layers.grouped_matmul import GroupedMatmul, default_grouped_matmul
from jaxllm.layers.linear import make_param
from jaxllm.layers.moe_glu import SWIGLU, ExpertGLU
from jaxllm.layers.moe_routing import (
    GroupedRouting,
    distinct_experts,
    grouped_route,
    local_keys,
    route,
    routed_slots,
)
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.quant import quantize_traced
from jaxllm.layers.row_reduce import NormWeight

# Steps of at most this many token rows take `routed_expert_ffn` (`small_token_limit`).
SMALL_TOKENS = 16
# The bodies of a small step's unquantized experts (`small_step_kernel`).
SMALL_KERNELS = ("loop", "pallas")


def small_token_limit(mesh: Mesh | None = None) -> int:
    """The most token rows a step may have to take `routed_expert_ffn`:
    `JAXLLM_MOE_SMALL_TOKENS` if set (a device sweep's knob; 0 turns the path off), else
    SMALL_TOKENS, and 0 on TPU, whose megablox kernel already skips experts no row
    routes to (the platform of `mesh`'s devices, else of this process's)."""
    chosen = os.environ.get("JAXLLM_MOE_SMALL_TOKENS")
    if chosen:
        if not chosen.isdigit():
            raise ParameterError("JAXLLM_MOE_SMALL_TOKENS",
                                 f"must be a whole number of tokens, got {chosen!r}")
        return int(chosen)
    return 0 if _platform(mesh) == "tpu" else SMALL_TOKENS


def small_step_kernel(mesh: Mesh | None = None) -> str:
    """How a small step runs unquantized experts: "pallas" (pallas_kernels/moe_small,
    the GPU default; Pallas interpret mode elsewhere, for tests) or "loop"
    (`routed_expert_ffn`, the default elsewhere); `JAXLLM_MOE_SMALL_KERNEL` if set."""
    chosen = os.environ.get("JAXLLM_MOE_SMALL_KERNEL")
    if chosen:
        if chosen not in SMALL_KERNELS:
            raise ParameterError("JAXLLM_MOE_SMALL_KERNEL",
                                 f"must be one of {', '.join(SMALL_KERNELS)}, got {chosen!r}")
        return chosen
    return "pallas" if _platform(mesh) == "gpu" else "loop"


def _platform(mesh: Mesh | None) -> str:
    """The platform of `mesh`'s devices, else of this process's."""
    return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def routed_expert_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array,
                      down: jax.Array, first_expert: jax.Array | int = 0, method: Any = None,
                      gate_up_scale: jax.Array | None = None,
                      down_scale: jax.Array | None = None,
                      input_scales: tuple[jax.Array, jax.Array] | None = None,
                      num_tokens: jax.Array | int | None = None, glu: ExpertGLU = SWIGLU,
                      biases: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`expert_ffn`'s result for a small step, reading each expert the real tokens
    routed to once and no other: a loop over `routed_experts`, each iteration one
    expert's gate/up and down products for every row (a tiny GEMM), added to the rows
    that routed there with their weights. Arguments as `expert_ffn`'s."""
    t = ids.shape[0]
    local, inter, hidden = gate_up.shape[0], gate_up.shape[2], gate_up.shape[3]
    key = local_keys(ids, first_expert, local, num_tokens)
    experts, count = distinct_experts(key, local)
    statics = input_scales or (None, None)

    def product(lhs: jax.Array, w: jax.Array, scale: jax.Array | None, i: int) -> jax.Array:
        if method is None:
            return jnp.einsum("tk,nk->tn", lhs, w,
                              preferred_element_type=jnp.float32).astype(x.dtype)
        return method.product(lhs, w, scale, 1, statics[i]).astype(x.dtype)

    def body(i: jax.Array, out: jax.Array) -> jax.Array:
        e = experts[i]
        hit = key == e  # [T, k]; a token picks an expert at most once

        def take(a: jax.Array | None, *shape: int) -> jax.Array | None:
            """Expert `e`'s slice of `a` (its weights or scales), reshaped to `shape`."""
            return None if a is None else jax.lax.dynamic_index_in_dim(
                a, e, keepdims=False).reshape(shape or a.shape[1:])

        h = product(x, take(gate_up, 2 * inter, hidden), take(gate_up_scale, 2 * inter), 0)
        if biases is not None:
            h = h + take(biases[0], 2 * inter)
        y = product(glu(h), take(down), take(down_scale), 1)
        if biases is not None:
            y = y + take(biases[1])
        w = jnp.sum(jnp.where(hit, weights, 0.0), axis=1)
        # where, not a product: the rows not routed here (padding ones too) may hold anything.
        return out + jnp.where(jnp.any(hit, axis=1)[:, None],
                               y.astype(jnp.float32) * w[:, None], 0.0)

    return jax.lax.fori_loop(0, count, body, jnp.zeros((t, hidden), jnp.float32))


def routed_expert_kernel(x: jax.Array, weights: jax.Array, ids: jax.Array,
                         gate_up: jax.Array, down: jax.Array,
                         first_expert: jax.Array | int = 0,
                         num_tokens: jax.Array | int | None = None,
                         interpret: bool = False) -> jax.Array:
    """`routed_expert_ffn`'s result for unquantized experts from the fused Pallas GPU
    kernels (pallas_kernels/moe_small): each routed expert's weights read in place, no
    loop on the host side. `interpret` runs them in Pallas interpret mode (any host)."""
    from pallas_kernels.moe_small import gpu

    slots = routed_slots(weights, ids, first_expert, gate_up.shape[0], num_tokens)
    return gpu.moe_small(x, gate_up, down, *slots, interpret=interpret)


def routed_logits_kernel(x: jax.Array, logits: jax.Array, gate_up: jax.Array,
                         down: jax.Array, top_k: int, renormalize: bool,
                         first_expert: jax.Array | int = 0,
                         num_tokens: jax.Array | int | None = None,
                         interpret: bool = False) -> jax.Array:
    """`routed_expert_kernel` of `route(logits, top_k, renormalize)`, the routing itself
    one more Pallas kernel (pallas_kernels/moe_small/routing.py: softmax, top-k and the
    slots in one program, where `route` and `routed_slots` take a dozen-odd small XLA
    kernels on the GPU, sorts among them)."""
    from pallas_kernels.moe_small import gpu

    return gpu.moe_small_from_logits(x, logits, gate_up, down, top_k, renormalize,
                                     first_expert, num_tokens, interpret=interpret)


def expert_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array,
               down: jax.Array, gmm: GroupedMatmul, first_expert: jax.Array | int = 0,
               method: Any = None, gate_up_scale: jax.Array | None = None,
               down_scale: jax.Array | None = None,
               input_scales: tuple[jax.Array, jax.Array] | None = None,
               num_tokens: jax.Array | int | None = None, glu: ExpertGLU = SWIGLU,
               biases: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`sum_j weights[t, j] * expert_{ids[t, j]}(x[t])` over the experts this call holds,
    `[T, hidden]` in float32 (partial sums over devices add up before the cast); rows
    from `num_tokens` on (padding tokens; None: none) route nowhere and come back zero.

    `gate_up [E_l, 2, I, H]` and `down [E_l, H, I]` are experts `first_expert ...
    first_expert + E_l - 1`; pairs routed to any other expert contribute zero (another
    device holds it). One argsort of the T*k pairs by local expert puts the pairs this
    call skips last, outside every group. `method` (quantized weights): layers/quant.py's,
    with the per-expert channel scales `gate_up_scale [E_l, 2, I]`, `down_scale [E_l, H]`
    (and, static fp8, the two products' activation scales `input_scales`). `glu`: the
    activation between the products (layers/moe_glu.py); `biases`: the gate/up and down
    products' per-expert biases `([E_l, 2, I], [E_l, H])` (GPT-OSS), or None.
    """
    t, k = ids.shape
    local, inter, hidden = gate_up.shape[0], gate_up.shape[2], gate_up.shape[3]
    key = local_keys(ids, first_expert, local, num_tokens).reshape(-1)
    mine = key < local
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
    if biases is not None:
        h = h + biases[0].reshape(local, 2 * inter)[row_expert]
    y = product(glu(h), down, down_scale, 1)
    if biases is not None:
        y = y + biases[1][row_expert]
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
                 method: Any = None, grouped: GroupedRouting | None = None,
                 biases: bool = False, glu: ExpertGLU = SWIGLU):
        """`grouped`: route by grouped sigmoid scores with a float32 router and correction
        bias (layers/moe_routing.py) instead of the softmax top-k. `biases`: the router's
        logits and each expert's two products add learned biases; `glu`: the experts'
        activation (both GPT-OSS's; they keep a step off the fused small-step kernels)."""
        e, i, h = num_experts, intermediate_size, hidden_size
        if not 1 <= top_k <= e:
            raise ParameterError("config.json:num_experts_per_tok",
                                 f"must be in [1, {e}] (the number of experts), got {top_k}")
        self.gmm = gmm or default_grouped_matmul(mesh)
        self.small_tokens = small_token_limit(mesh)
        self.small_kernel = small_step_kernel(mesh)
        self.kernel_interpret = _platform(mesh) != "gpu"
        self.mesh = mesh if mesh is not None and mesh.shape["model"] > 1 else None
        if self.mesh is not None and e % self.mesh.shape["model"]:
            raise ParameterError("tensor_parallel_size", f"{self.mesh.shape['model']} does not "
                                 f"divide the {e} experts (each device holds whole experts)")
        self.top_k, self.renormalize = top_k, renormalize
        # The partial outputs' sum over 'model' for the steps it takes
        # (layers/row_reduce.py), attached after loading; None: psum.
        self.reduce: nnx.Module | None = nnx.data(None)
        self.grouped = grouped
        self.router = make_param(rngs, (e, h), jnp.float32 if grouped else dtype, P(None, None))
        self.e_score_correction_bias = (make_param(rngs, (e,), jnp.float32, P(None), "zeros")
                                        if grouped is not None and grouped.bias else None)
        self.router_bias = (make_param(rngs, (e,), self.router.get_value().dtype, P(None),
                                       "zeros") if biases else None)
        self.method, self.glu = method, glu
        self.gate_up_proj, self.gate_up_proj_scale = _experts(rngs, (e, 2, i, h), dtype, method)
        self.down_proj, self.down_proj_scale = _experts(rngs, (e, h, i), dtype, method)
        self.gate_up_proj_bias, self.down_proj_bias = (
            (make_param(rngs, (e, 2, i), dtype, P("model", None, None), "zeros"),
             make_param(rngs, (e, h), dtype, P("model", None), "zeros")) if biases
            else (None, None))
        # Static fp8: one activation scale per product, the largest of every expert's
        # (vLLM's choice), replicated.
        static = getattr(method, "static", False)
        self.gate_up_proj_input_scale, self.down_proj_input_scale = (
            (make_param(rngs, (), jnp.float32, P(), "ones"),
             make_param(rngs, (), jnp.float32, P(), "ones")) if static else (None, None))

    def __call__(self, x: jax.Array, residual: jax.Array | None,
                 num_tokens: jax.Array | None = None) -> jax.Array:
        """`residual` plus the experts' weighted output for the normed input `x` (the
        output alone when `residual` is None), as the decoder calls every MLP. Rows
        from `num_tokens` on (the step's padding; None: none) get no expert output."""
        router = self.router[...]
        logits = jnp.einsum("th,eh->te", x.astype(router.dtype), router,
                            preferred_element_type=jnp.float32)
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        experts = (self.gate_up_proj[...], self.down_proj[...])
        if self.method is not None:
            experts += (self.gate_up_proj_scale[...], self.down_proj_scale[...])
        biases = (() if self.gate_up_proj_bias is None else
                  (self.gate_up_proj_bias[...], self.down_proj_bias[...]))
        statics = (() if self.gate_up_proj_input_scale is None else
                   (self.gate_up_proj_input_scale[...], self.down_proj_input_scale[...]))

        num_tokens = jnp.asarray(x.shape[0] if num_tokens is None else num_tokens, jnp.int32)
        small = x.shape[0] <= self.small_tokens  # static: the step's bucket
        tp = 1 if self.mesh is None else self.mesh.shape["model"]
        kernels = small and self._fused(x, experts[0].shape[0] // tp, *experts[0].shape[2:])
        # The fused path routes inside its kernels (softmax top-k only); the others take
        # the routing's pairs.
        fused = kernels and self.grouped is None
        if fused:
            routing = logits
        elif self.grouped is None:
            routing = route(logits, self.top_k, self.renormalize)
        else:
            routing = grouped_route(logits, self.e_score_correction_bias, self.grouped)

        def ffn(x, routing, statics, biases, num_tokens, *experts, first=0):
            if fused:
                return routed_logits_kernel(x, routing, *experts[:2], self.top_k,
                                            self.renormalize, first, num_tokens,
                                            self.kernel_interpret)
            if kernels:
                return routed_expert_kernel(x, *routing, *experts[:2], first, num_tokens,
                                            self.kernel_interpret)
            kw = dict(input_scales=statics or None, num_tokens=num_tokens, glu=self.glu,
                      biases=biases or None)
            if small:
                return routed_expert_ffn(x, *routing, *experts[:2], first, self.method,
                                         *experts[2:], **kw)
            return expert_ffn(x, *routing, *experts[:2], self.gmm, first, self.method,
                              *experts[2:], **kw)

        args = (x, routing, statics, biases, num_tokens, *experts)
        if self.mesh is None:
            out = ffn(*args)
        else:
            def partial(x, routing, statics, biases, num_tokens, *experts):
                first = jax.lax.axis_index("model") * experts[0].shape[0]
                return ffn(x, routing, statics, biases, num_tokens, *experts, first=first)

            # Each device adds its own experts' biases, so every pair's count once.
            in_specs = (P(),) * 3 + (P("model"), P()) + (P("model"),) * len(experts)
            # The partial outputs' sum: the row reduce where it takes the step (sized
            # for float32 partials), else psum.
            if self.reduce is not None and self.reduce.takes(*x.shape, jnp.float32):
                out = self.reduce.product(partial, args, in_specs)
            else:
                out = jax.shard_map(lambda *a: jax.lax.psum(partial(*a), "model"),
                                    mesh=self.mesh, in_specs=in_specs, out_specs=P(),
                                    check_vma=False)(*args)
        out = out.astype(x.dtype)
        return out if residual is None else residual + out

    def add_norm(self, x: jax.Array, residual: jax.Array, num_tokens: jax.Array | None,
                 norm: NormWeight, eps: float, offset: bool) -> tuple[jax.Array, jax.Array]:
        """`y = self(x, residual, num_tokens)` and `rms_norm(y, norm.weight, eps, offset)`,
        as `GatedMLP.add_norm` (here apart: the partial outputs are summed in float32)."""
        y = self(x, residual, num_tokens)
        return y, rms_norm(y, norm.weight, eps, offset)

    def _fused(self, x: jax.Array, local: int, inter: int, hidden: int) -> bool:
        """Whether a small step takes the fused kernels: chosen, unquantized SwiGLU experts
        without biases (all the kernels compute), and sizes their tiles take (`local`
        experts per device)."""
        if (self.small_kernel != "pallas" or self.method is not None or self.glu != SWIGLU
                or self.gate_up_proj_bias is not None or self.router_bias is not None):
            return False
        from pallas_kernels.moe_small import gpu

        return gpu.supported(local, hidden, inter, x.shape[0])


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
