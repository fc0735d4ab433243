"""RMSNorm as Hugging Face computes it, statistics in float32.

Llama's: normalize in float32, cast back to the input dtype, then multiply by
the weight. Gemma's (`offset=True`): multiply by `1 + weight` in float32, then
cast; its checkpoints store the weight minus one. Doing the same as each keeps
bf16 outputs bit-close to it. The weight is tiny and replicated on every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
    """Normalizes over the last axis of `x`; `weight` has that axis' size; `offset`:
    Gemma's `1 + weight` scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Cohere's LayerNorm over the last axis: mean-centred, no bias; the weight applied
    in float32, then cast back, as Hugging Face computes it."""
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


class RMSNorm(nnx.Module):
    """`weight * x / rms(x)` (`offset`: `(1 + weight) * ...`) over the last axis (size `dim`)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, offset: bool = False):
        self.eps = float(eps)
        self.offset = offset
        init = "zeros" if offset else "ones"  # the identity either way
        self.weight = nnx.Param((jnp.zeros if offset else jnp.ones)((dim,), dtype),
                                out_sharding=P(None), eager_sharding=False, dummy_init=init)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, self.offset)
