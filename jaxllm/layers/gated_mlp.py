"""The gated MLP every dense family uses: `down(act(x @ gate.T) * (x @ up.T))`.

SwiGLU (act = SiLU: Llama, Mistral, Qwen) and GeGLU (act = tanh-approximated
GELU: Gemma). Gate and up are one fused `[2, I, H]` weight, column parallel over
'model'; down is `[H, I]`, row parallel. SwiGLU's up-projection goes through the
`SwiGLU` object (jaxllm/layers/mlp.py: XLA or the fused GPU kernel), its down
projection through the `MatmulAdd` (residual add in the epilogue).

An MLP module takes `(x, residual, num_tokens)` and returns `residual + mlp(x)`,
or `mlp(x)` alone when `residual` is None (families that norm the MLP's output
before the add); `num_tokens` counts the real rows, which a sparse MLP may use.
The decoder picks one MLP per layer (`models/decoder.py`'s factory), so a
mixture-of-experts MLP drops in beside this one.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError
from jaxllm.layers.linear import Linear, make_param
from jaxllm.layers.mlp import SwiGLU
from jaxllm.layers.row_reduce import NormWeight

# Hugging Face `hidden_act` / `hidden_activation` names -> the gate's activation.
ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
}


def activation_name(hf_name: str, field: str = "config.json:hidden_act") -> str:
    """The gate activation for a Hugging Face activation name, or a clear error."""
    try:
        return ACTIVATIONS[hf_name]
    except KeyError:
        raise ParameterError(field, f"{hf_name!r} is not supported; supported: "
                             f"{', '.join(sorted(ACTIVATIONS))}") from None


class GatedMLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, *, activation: str, bias: bool,
                 dtype: jnp.dtype, rngs: nnx.Rngs, swiglu: SwiGLU, method: Any = None):
        self.activation = activation
        self.swiglu = swiglu
        self.gate_up_proj = Linear((2, inter), (hidden,), P(None, "model", None), dtype=dtype,
                                   rngs=rngs, bias=bias, method=method)
        self.down_proj = Linear((hidden,), (inter,), P(None, "model"), dtype=dtype, rngs=rngs,
                                bias=bias, bias_spec=P(None), matmul_add=swiglu.matmul_add,
                                method=method)

    def __call__(self, x: jax.Array, residual: jax.Array | None,
                 num_tokens: jax.Array | None = None) -> jax.Array:
        """`residual + mlp(x)` (`mlp(x)` when `residual` is None) for the normed input `x`;
        every row, `num_tokens` (the step's real rows) or not: a dense product costs the
        same either way."""
        if residual is None:
            return self.down_proj(self._gated(x))
        return self.down_proj.add(self._gated(x), residual)

    def add_norm(self, x: jax.Array, residual: jax.Array, num_tokens: jax.Array | None,
                 norm: NormWeight, eps: float, offset: bool) -> tuple[jax.Array, jax.Array]:
        """`y = self(x, residual, num_tokens)` and `rms_norm(y, norm.weight, eps, offset)`
        (the next block's input), the norm with the down projection's sum where it can."""
        return self.down_proj.add_norm(self._gated(x), residual, norm, eps, offset)

    def _gated(self, x: jax.Array) -> jax.Array:
        """`act(x @ gate.T) * (x @ up.T)`, the down projection's input."""
        up = self.gate_up_proj
        if self.activation == "silu" and up.plain and up.lora is None:
            return self.swiglu(x, up.weight[...], None if up.bias is None else up.bias[...])
        # GeGLU, a quantized weight, or an adapter's term joining the product
        gate_up = up(x)
        act = jax.nn.silu if self.activation == "silu" else functools.partial(
            jax.nn.gelu, approximate=True)
        return act(gate_up[:, 0]) * gate_up[:, 1]


def _relu2(x: jax.Array) -> jax.Array:
    return jnp.square(jax.nn.relu(x))


# A non-gated MLP's activations, by `DecoderArch.activation` (Hugging Face's names mapped
# by PLAIN_ACTIVATIONS).
_PLAIN = {"relu2": _relu2, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
          "silu": jax.nn.silu}
PLAIN_ACTIVATIONS = {"relu2": "relu2", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
                     "xielu": "xielu"}


def xielu(x: jax.Array, params: jax.Array) -> jax.Array:
    """Apertus's xIELU with its learned `params` [alpha_p, alpha_n, beta, eps] (the raw
    parameters as stored: the alphas before their softplus), in `x`'s dtype as Hugging
    Face's Python form computes it."""
    alpha_p_raw, alpha_n_raw, beta, eps = (params[i].astype(x.dtype) for i in range(4))
    alpha_p = jax.nn.softplus(alpha_p_raw)
    alpha_n = beta + jax.nn.softplus(alpha_n_raw)
    return jnp.where(x > 0, alpha_p * x * x + beta * x,
                     (jnp.expm1(jnp.minimum(x, eps)) - x) * alpha_n + beta * x)


class PlainMLP(nnx.Module):
    """The non-gated MLP `down(act(x @ up.T))` (Arcee's ReLU², Apertus's xIELU): up
    `[I, H]` column parallel, down `[H, I]` row parallel, called as GatedMLP is. xIELU's
    four learned scalars sit in `act_params`."""

    def __init__(self, hidden: int, inter: int, *, activation: str, bias: bool,
                 dtype: jnp.dtype, rngs: nnx.Rngs, swiglu: SwiGLU, method: Any = None):
        if activation == "xielu":
            self.act_params = make_param(rngs, (4,), dtype, P(None), "zeros")
        self.activation = activation
        self.up_proj = Linear((inter,), (hidden,), P("model", None), dtype=dtype, rngs=rngs,
                              bias=bias, method=method)
        self.down_proj = Linear((hidden,), (inter,), P(None, "model"), dtype=dtype, rngs=rngs,
                                bias=bias, bias_spec=P(None), matmul_add=swiglu.matmul_add,
                                method=method)

    def __call__(self, x: jax.Array, residual: jax.Array | None,
                 num_tokens: jax.Array | None = None) -> jax.Array:
        if residual is None:
            return self.down_proj(self._act(self.up_proj(x)))
        return self.down_proj.add(self._act(self.up_proj(x)), residual)

    def add_norm(self, x: jax.Array, residual: jax.Array, num_tokens: jax.Array | None,
                 norm: NormWeight, eps: float, offset: bool) -> tuple[jax.Array, jax.Array]:
        return self.down_proj.add_norm(self._act(self.up_proj(x)), residual, norm, eps, offset)

    def _act(self, y: jax.Array) -> jax.Array:
        if self.activation == "xielu":
            return xielu(y, self.act_params[...])
        return _PLAIN[self.activation](y)

