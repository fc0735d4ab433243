"""RMSNorm as the Llama family computes it: statistics in float32, scale in the model dtype.

Hugging Face normalizes in float32, casts back to the input dtype and only then
multiplies by the weight; doing the same keeps bf16 outputs bit-close to it.
The weight is tiny and replicated on every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalizes over the last axis of `x`; `weight` has that axis' size."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


class RMSNorm(nnx.Module):
    """`weight * x / rms(x)` over the last axis (size `dim`)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), dtype), out_sharding=P(None),
                                eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
