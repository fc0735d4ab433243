"""`Linear`: one projection's weight, its sharding, and the method that applies it.

Weights keep Hugging Face's `[out..., in...]` orientation (loading is a reshape,
never a transpose); a projection may have several output axes (the fused qkv
weight `[kv_heads, G + 2, D, hidden]`) or several input axes (the output
projection `[hidden, heads, D]`). The weight declares its sharding next to its
definition. How the product is computed is the layer's `method`, a static
object: `UnquantizedLinear` is the plain einsum; a quantized method (int8 / fp8
weights with scales) replaces it without touching the model code.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.layers import row_reduce
from jaxllm.layers.mlp import MatmulAdd
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.quant import quantize_traced

INIT_STD = 0.02  # dummy weights: small enough that activations stay finite


def make_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, spec: P,
               init: str = "normal") -> nnx.Param:
    """A parameter of `shape` declaring its sharding `spec` ("normal", "ones" or "zeros")."""
    if init == "normal":
        value = (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    else:
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    # Placement happens in the loader (or a jitted init's out_shardings), not here;
    # `dummy_init` lets the loader draw dummy weights per shape (models/loader.py).
    return nnx.Param(value, out_sharding=spec, eager_sharding=False, dummy_init=init)


@dataclasses.dataclass(frozen=True)
class UnquantizedLinear:
    """The plain product `x @ W.T (+ b)` over the weight's trailing input axes.

    The quantization hook: a method gets the layer itself, so a quantized one reads
    the parameters it created there (int8 / fp8 weight, scales) instead of `weight`.
    """

    def apply(self, layer: Linear, x: jax.Array) -> jax.Array:
        w = layer.weight[...]
        letters = string.ascii_lowercase
        ins, outs = letters[:layer.in_dims], letters[layer.in_dims:w.ndim]
        out = jnp.einsum(f"T{ins},{outs}{ins}->T{outs}", x, w)
        return out if layer.bias is None else out + layer.bias[...]

    def apply_add(self, layer: Linear, x: jax.Array, residual: jax.Array) -> jax.Array:
        """`residual + x @ W.T (+ bias)` as one `[T, K] x [N, K]` product (a fused
        kernel where the layer's `matmul_add` has one)."""
        w = layer.weight[...]
        return layer.matmul_add(x.reshape(x.shape[0], -1), w.reshape(w.shape[0], -1), residual,
                                None if layer.bias is None else layer.bias[...])


class Linear(nnx.Module):
    """`x [T, *in] -> [T, *out]` with weight `[*out, *in]` (+ bias `[*out]`)."""

    def __init__(self, out_shape: tuple[int, ...], in_shape: tuple[int, ...], spec: P, *,
                 dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False,
                 bias_spec: P | None = None, method: Any = None,
                 matmul_add: MatmulAdd | None = None):
        self.in_dims = len(in_shape)
        self.spec = spec
        self.method = method or UnquantizedLinear()
        if isinstance(self.method, UnquantizedLinear):
            self.weight = make_param(rngs, (*out_shape, *in_shape), dtype, spec)
            self.weight_scale = None
        else:  # quantized (layers/quant.py): dummy weights are quantized random ones
            w = make_param(rngs, (*out_shape, *in_shape), jnp.float32, spec)
            q, scale = quantize_traced(self.method, w[...], self.in_dims)
            self.weight = nnx.Param(q, out_sharding=spec, eager_sharding=False)
            # One scale per output channel, sharded with the output channels.
            self.weight_scale = nnx.Param(scale, out_sharding=P(*spec[:len(out_shape)]),
                                          eager_sharding=False)
        # A static activation scale (an FP8 checkpoint's `input_scale`), one per layer.
        self.input_scale = (make_param(rngs, (), jnp.float32, P(), "ones")
                            if getattr(self.method, "static", False) else None)
        self.bias = (make_param(rngs, out_shape, dtype,
                                bias_spec if bias_spec is not None else P(*spec[:len(out_shape)]),
                                "zeros") if bias else None)
        self.matmul_add = matmul_add or MatmulAdd()
        # Multi-LoRA's adapter tables (jaxllm/lora/layers.py), attached after loading
        # when LoRA is enabled; None keeps the product exactly the base one.
        self.lora: nnx.Module | None = nnx.data(None)
        # A row-parallel projection's sum over 'model' for the steps it takes
        # (layers/row_reduce.py), attached after loading; None: XLA's all-reduce.
        self.reduce: nnx.Module | None = nnx.data(None)

    @property
    def plain(self) -> bool:
        """Whether the weight is a plain matrix that fused kernels may read directly."""
        return isinstance(self.method, UnquantizedLinear)

    def __call__(self, x: jax.Array) -> jax.Array:
        reduced = row_reduce.linear_product(self, x)
        if reduced is not None:
            return reduced
        out = self.method.apply(self, x)
        return out if self.lora is None else out + self.lora(x)

    def split(self, x: jax.Array, parts: int) -> jax.Array:
        """`self(x)`, or its float32 split-K partials `[parts, T, *out]`
        (`row_reduce.split_partials`) where `parts` > 1 cuts the contraction into slices
        of at least `row_reduce.MIN_SPLIT_WIDTH` and the product is plain: an unquantized
        weight, no bias, adapter or row-parallel sum."""
        parts = row_reduce.split_count(x.size // x.shape[0], parts)
        if parts and self.plain and self.bias is None and self.lora is None and self.reduce is None:
            return row_reduce.split_partials(x, self.weight[...], parts)
        return self(x)

    def add(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        """`residual + self(x)` for a projection with one output axis (the residual
        add in the product's epilogue where the `MatmulAdd` has a kernel)."""
        reduced = row_reduce.linear_product(self, x)
        if reduced is not None:
            return residual + reduced
        if self.lora is not None:
            residual = residual + self.lora(x)
        return self.method.apply_add(self, x, residual)

    def add_norm(self, x: jax.Array, residual: jax.Array, norm: row_reduce.NormWeight,
                 eps: float, offset: bool) -> tuple[jax.Array, jax.Array]:
        """`y = self.add(x, residual)` and `rms_norm(y, norm.weight, eps, offset)`: in one
        kernel with a row-parallel product's sum where its reduce takes the step."""
        fused = row_reduce.linear_add_norm(self, x, residual, norm, eps, offset)
        if fused is not None:
            return fused
        y = self.add(x, residual)
        return y, rms_norm(y, norm.weight, eps, offset)

