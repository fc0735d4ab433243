"""A projection plus its residual in plain jnp: the oracle for `gpu_mgpu.py`.

`residual + x @ w.T` for `x [T, K]`, `w [N, K]` (Hugging Face's `[out, in]`
orientation) and `residual [T, N]`, all in float32; the result in `x.dtype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_add(x: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array:
    """`residual + x @ w.T` computed in float32, returned in `x.dtype`."""
    out = jnp.einsum("tk,nk->tn", x.astype(jnp.float32), w.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return (residual.astype(jnp.float32) + out).astype(x.dtype)
