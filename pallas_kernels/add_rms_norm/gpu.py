"""A residual add and the RMSNorm of its sum as one Pallas GPU kernel (Triton lowering).

A decoder layer adds the attention block's output to the residual stream and normalizes
the sum for the MLP. XLA runs the two as two kernels at a decode step (the add, whose
output the next residual add also reads, is not fused into the norm's reduction), and
at a few token rows each kernel costs its launch and tail, not its bytes. Here one
program per token row reads the row of `x` and of `residual`, writes their sum, and
writes the sum normalized, with the rounding of the unfused ops (jaxllm.layers.norm's
`rms_norm`, the oracle):

    s = residual + x                          (the model dtype)
    n = float32(s) * rsqrt(mean(float32(s)^2) + eps)
    out = (n * (1 + w)).astype(dtype)         (offset: Gemma's `1 + w`, in float32)
    out = w * n.astype(dtype)                 (otherwise: the product in the model dtype)

The row is padded to a power of two of lanes (Triton tiles), the lanes past H masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import load as _load
from pallas_kernels.triton_util import store as _store


def _kernel(x_ref, r_ref, w_ref, sum_ref, out_ref, *, eps: float, offset: bool):
    t = pl.program_id(0)
    hidden = w_ref.shape[0]
    width = pl.next_power_of_2(hidden)
    col = lax.broadcasted_iota(jnp.int32, (width,), 0)
    inside = col < hidden
    flat = t * hidden + col
    dtype = sum_ref.dtype
    x = _load(x_ref, (flat,), mask=inside, other=0.0).astype(jnp.float32)
    r = _load(r_ref, (flat,), mask=inside, other=0.0).astype(jnp.float32)
    s = (r + x).astype(dtype)
    _store(sum_ref, (flat,), s, mask=inside)
    s32 = s.astype(jnp.float32)
    n = s32 * lax.rsqrt(jnp.sum(s32 * s32) / hidden + eps)
    w = _load(w_ref, (col,), mask=inside, other=0.0).astype(jnp.float32)
    if offset:
        out = n * (1.0 + w)
    else:
        out = w * n.astype(dtype).astype(jnp.float32)
    _store(out_ref, (flat,), out.astype(dtype), mask=inside)


def add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array, *, eps: float,
                 offset: bool = False, interpret: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
    """`(s, rms_norm(s, weight, eps, offset))` with `s = residual + x`, both `[T, H]` in
    the dtype of `x` and `residual` (one dtype), `weight [H]`."""
    t, hidden = residual.shape
    if x.shape != residual.shape or weight.shape != (hidden,) or x.dtype != residual.dtype:
        raise ValueError(f"x {x.shape} {x.dtype}, residual {residual.shape} {residual.dtype} "
                         f"and weight {weight.shape} must be [T, H], [T, H] of one dtype, "
                         f"and [H]")
    dtype = residual.dtype
    warps = 4 if hidden <= 4096 else 8
    s, out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), offset=offset),
        out_shape=(jax.ShapeDtypeStruct((t * hidden,), dtype),
                   jax.ShapeDtypeStruct((t * hidden,), dtype)),
        grid=(t,),
        compiler_params=_compiler_params(warps, 1),
        interpret=interpret, name="add_rms_norm",
    )(x.reshape(-1), residual.reshape(-1), weight)
    return s.reshape(t, hidden), out.reshape(t, hidden)
