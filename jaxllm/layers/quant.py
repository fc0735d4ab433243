"""Quantized linear methods: int8 weight-only and FP8 (e4m3) W8A8.

A quantized `Linear` (layers/linear.py) stores its weight `[*out, *in]` in the
method's `weight_dtype` next to a float32 `weight_scale` `[*out]`, one scale per
output channel, sharded with the output channels; the real weight is
`weight * weight_scale[..., None]`. Both methods leave the activations' dtype
as it comes and return it. Two products:

  * weight-only (`weight_only_product`): the quantized weight is upcast to the
    activations' dtype as the dot's operand (XLA can fuse the convert into the
    GEMM, so the weight streams from memory at one byte an element), accumulated
    in float32, and scaled per output channel. `Int8WeightOnly`
    (`--quantization int8`) always runs it.
  * W8A8 (`Fp8Linear.w8a8_product`): activations get a dynamic per-token scale
    (`amax / 448` over the token's input features), both operands go to
    float8_e4m3fn and the dot takes fp8 operands with a float32 result (XLA's
    FP8 GEMM on Hopper; upcast elsewhere), then both scales are applied. With
    `static` (an FP8 checkpoint's `activation_scheme: static`) the activations'
    scale is instead the layer's one float32 `input_scale`, read from the
    checkpoint (the largest of the fused parts', as vLLM), values past e4m3's
    range saturating.

`Fp8Linear` (`--quantization fp8`) picks one of the two per product from its
row count, which is static in each compiled program (a token bucket, or the
request rows of a last layer): up to `weight_only_tokens` rows it runs
weight-only, since a GEMM that few rows tall is bound by reading the weight and
quantizing the activations only adds kernels; above, W8A8, where the FP8 GEMM's
compute rate counts. The threshold is `FP8_WEIGHT_ONLY_TOKENS`, or the
environment's `JAXLLM_FP8_WEIGHT_ONLY_TOKENS` (0: always W8A8), read when the
model is built.

The mixture-of-experts layer's stacked expert weights (layers/moe.py) take the
same methods through `grouped`: one scale per expert and output channel, the
grouped matmul (layers/grouped_matmul.py) taking the quantized operands and the
scales applied to its float32 result, each row by its expert's; fp8 experts choose
between the two products by the grouped matmul's rows (token-expert pairs).

On GPU, a program whose products run W8A8 (a token bucket above the threshold)
compiles its GEMMs through cuBLASLt's FP8 GEMM rather than XLA's Triton GEMM
(`xla_compiler_options`): autotuning the Triton fusions of the fp8 operands kept a
large bucket compiling for many minutes, where cuBLASLt's candidates take seconds.
The weight-only buckets keep Triton, which fuses the weight's upcast into the GEMM.

The host-side quantizers (`quantize_per_channel`) are what the loader uses on
a float checkpoint; they round the same way on every host (`quantize_traced` is
the same rounding in jnp, for dummy weights).
"""

from __future__ import annotations

import dataclasses
import os
import string
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm.errors import ParameterError

QUANTIZATIONS = ("fp8", "int8")
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
# Rows up to which an fp8 product runs weight-only (see above); a device benchmark's
# knob (scripts/bench_fp8_gemm.py measures both products per row count).
FP8_WEIGHT_ONLY_TOKENS = 64
WEIGHT_ONLY_ENV = "JAXLLM_FP8_WEIGHT_ONLY_TOKENS"


def fp8_weight_only_tokens() -> int:
    """The fp8 weight-only threshold: `JAXLLM_FP8_WEIGHT_ONLY_TOKENS`, else the default."""
    raw = os.environ.get(WEIGHT_ONLY_ENV)
    if raw is None or raw == "":
        return FP8_WEIGHT_ONLY_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ParameterError(WEIGHT_ONLY_ENV, f"must be a whole number >= 0, got {raw!r}")
    return value


def einsum_spec(x_ndim_in: int, w_ndim: int) -> str:
    """`x [T, *in] , w [*out, *in] -> [T, *out]` for `x_ndim_in` input axes."""
    letters = string.ascii_lowercase
    ins, outs = letters[:x_ndim_in], letters[x_ndim_in:w_ndim]
    return f"T{ins},{outs}{ins}->T{outs}"


def weight_only_product(x: jax.Array, w: jax.Array, scale: jax.Array, in_dims: int,
                        input_scale: None = None) -> jax.Array:
    """`x @ (W * scale).T` with the quantized `W` upcast to `x`'s dtype as the dot's
    operand (exact: every int8 and e4m3 value is a bfloat16 value) and the per-channel
    scale applied after the float32 accumulation; no activation quantization."""
    out = jnp.einsum(einsum_spec(in_dims, w.ndim), x, w.astype(x.dtype),
                     preferred_element_type=jnp.float32)
    return (out * scale).astype(x.dtype)


class _QuantizedMethod:
    """`Linear`'s method interface (layers/linear.py) over `product`."""

    static = False  # whether the layer holds a static activation `input_scale`

    def apply(self, layer: Any, x: jax.Array) -> jax.Array:
        out = self.product(x, layer.weight[...], layer.weight_scale[...], layer.in_dims,
                           layer.input_scale[...] if self.static else None)
        return out if layer.bias is None else out + layer.bias[...]

    def apply_add(self, layer: Any, x: jax.Array, residual: jax.Array) -> jax.Array:
        # The fused matmul-add kernel reads float weights only: a plain add here.
        return residual + self.apply(layer, x)

    def grouped(self, gmm: Any, x: jax.Array, w: jax.Array, scale: jax.Array,
                group_sizes: jax.Array, row_group: jax.Array,
                input_scale: jax.Array | None = None) -> jax.Array:
        """`gmm`'s product of rows `x [M, K]` sorted by group with the quantized group
        weights `w [G, N, K]`, `scale [G, N]`, in float32 `[M, N]`; `row_group [M]` is
        each row's group (any valid group for rows outside every group);
        `input_scale`: the static activation scale (`static` methods)."""
        xq, x_scale = self.activations(x, 1, input_scale)
        out = gmm(xq, w, group_sizes, out_dtype=jnp.float32) * scale[row_group]
        return out if x_scale is None else out * x_scale


@dataclasses.dataclass(frozen=True)
class Int8WeightOnly(_QuantizedMethod):
    """`x @ (int8 W * scale).T` with the scale applied after the float32 accumulation."""

    name = "int8"
    weight_dtype = jnp.dtype(jnp.int8)

    def product(self, x: jax.Array, w: jax.Array, scale: jax.Array, in_dims: int,
                input_scale: None = None) -> jax.Array:
        return weight_only_product(x, w, scale, in_dims)

    def activations(self, x: jax.Array, in_dims: int = 1, input_scale: None = None
                    ) -> tuple[jax.Array, None]:
        """Weight-only: the activations go in as they are."""
        return x, None

    def quantize(self, w: np.ndarray, in_dims: int) -> tuple[np.ndarray, np.ndarray]:
        return quantize_per_channel(w, in_dims, "int8")


@dataclasses.dataclass(frozen=True)
class Fp8Linear(_QuantizedMethod):
    """e4m3 weights with per-output-channel scales: weight-only up to
    `weight_only_tokens` rows, else W8A8 with dynamic per-token activation scales
    (`static`: the layer's one static activation scale)."""

    static: bool = False
    weight_only_tokens: int = FP8_WEIGHT_ONLY_TOKENS
    name = "fp8"
    weight_dtype = jnp.dtype(jnp.float8_e4m3fn)

    def weight_only(self, rows: int) -> bool:
        """Whether a product of `rows` rows (static in a compiled program) is weight-only."""
        return rows <= self.weight_only_tokens

    def product(self, x: jax.Array, w: jax.Array, scale: jax.Array, in_dims: int,
                input_scale: jax.Array | None = None) -> jax.Array:
        if self.weight_only(x.shape[0]):
            return weight_only_product(x, w, scale, in_dims)
        return self.w8a8_product(x, w, scale, in_dims, input_scale)

    def w8a8_product(self, x: jax.Array, w: jax.Array, scale: jax.Array, in_dims: int,
                     input_scale: jax.Array | None = None) -> jax.Array:
        """Both operands in e4m3, a float32 dot, then both scales."""
        xq, x_scale = self.quantized_activations(x, in_dims, input_scale)
        out = jnp.einsum(einsum_spec(in_dims, w.ndim), xq, w,
                         preferred_element_type=jnp.float32)
        if x_scale.ndim:
            x_scale = x_scale.reshape(x.shape[0], *([1] * (out.ndim - 1)))
        return (out * x_scale * scale).astype(x.dtype)

    def activations(self, x: jax.Array, in_dims: int = 1,
                    input_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """The grouped matmul's left operand and its scale: `(x, None)` where the rows
        run weight-only, else `quantized_activations`."""
        if self.weight_only(x.shape[0]):
            return x, None
        return self.quantized_activations(x, in_dims, input_scale)

    def quantized_activations(self, x: jax.Array, in_dims: int = 1,
                              input_scale: jax.Array | None = None
                              ) -> tuple[jax.Array, jax.Array]:
        """`(e4m3 x / s, s)` with `s` `[T, 1...]` each token's `amax / 448` over its
        trailing `in_dims` input axes, or the static scalar `input_scale`."""
        xf = x.astype(jnp.float32)
        if input_scale is not None:
            s = input_scale.astype(jnp.float32)
            return jnp.clip(xf / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), s
        in_axes = tuple(range(1, 1 + in_dims))
        amax = jnp.max(jnp.abs(xf), axis=in_axes, keepdims=True)
        x_scale = jnp.maximum(amax, 1e-12) / FP8_MAX  # an all-zero token stays zero
        return (xf / x_scale).astype(jnp.float8_e4m3fn), x_scale

    def quantize(self, w: np.ndarray, in_dims: int) -> tuple[np.ndarray, np.ndarray]:
        return quantize_per_channel(w, in_dims, "fp8")


def xla_compiler_options(quantization: str | None, rows: int, platform: str
                         ) -> dict[str, Any]:
    """XLA options for compiling a step program of `rows` token rows (module docstring):
    Triton GEMMs off for an fp8 program whose products run W8A8 on GPU, else none."""
    if platform != "gpu" or not (quantization or "").startswith("fp8"):
        return {}
    if rows <= fp8_weight_only_tokens():
        return {}
    return {"xla_gpu_enable_triton_gemm": False}


def linear_method(quantization: str | None):
    """The `Linear` method for a `--quantization` value or "fp8_static" (None: the
    plain product). "fp8_static": fp8 with static activation scales, what an FP8
    checkpoint's quantization_config asks for (quant_config.py); never a flag. The
    fp8 methods take the weight-only threshold the environment sets now."""
    if quantization is None:
        return None
    if quantization == "int8":
        return Int8WeightOnly()
    if quantization in ("fp8", "fp8_static"):
        return Fp8Linear(static=quantization == "fp8_static",
                         weight_only_tokens=fp8_weight_only_tokens())
    raise ParameterError("quantization", f"must be one of {QUANTIZATIONS} or None, "
                         f"got {quantization!r}")


def quantize_per_channel(w: np.ndarray, in_dims: int, kind: str
                         ) -> tuple[np.ndarray, np.ndarray]:
    """`(q, scale)` with `q * scale[..., None...] ~= w`: one float32 scale per output
    channel (the leading `w.ndim - in_dims` axes), `amax / qmax` over the trailing
    input axes (a zero channel gets scale 1)."""
    w = np.asarray(w, np.float32)
    in_axes = tuple(range(w.ndim - in_dims, w.ndim))
    amax = np.max(np.abs(w), axis=in_axes)
    qmax = INT8_MAX if kind == "int8" else FP8_MAX
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    scaled = w / scale.reshape(scale.shape + (1,) * in_dims)
    if kind == "int8":
        q = np.clip(np.rint(scaled), -INT8_MAX, INT8_MAX).astype(np.int8)
    else:
        q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def quantize_traced(method: Any, w: jax.Array, in_dims: int) -> tuple[jax.Array, jax.Array]:
    """Per-output-channel quantization of a (traced) float weight, rounded as
    `quantize_per_channel` rounds (dummy weights)."""
    in_axes = tuple(range(w.ndim - in_dims, w.ndim))
    qmax = INT8_MAX if method.weight_dtype == jnp.int8 else FP8_MAX
    amax = jnp.max(jnp.abs(w), axis=in_axes)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    scaled = w / scale.reshape(scale.shape + (1,) * in_dims)
    if method.weight_dtype == jnp.int8:
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, -qmax, qmax).astype(method.weight_dtype), scale


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight a quantized (weight, per-output-channel scale) pair stands for."""
    scale = np.asarray(scale, np.float32)
    return q.astype(np.float32) * scale.reshape(scale.shape + (1,) * (q.ndim - scale.ndim))
