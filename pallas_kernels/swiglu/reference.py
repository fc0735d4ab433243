"""The SwiGLU up-projection in plain jnp: the oracle for `gpu_mgpu.py`.

`x [T, H]` times the stacked gate/up weight `w [2, I, H]` (Hugging Face's
`[out, in]` orientation: `w[0]` is `gate_proj.weight`, `w[1]` `up_proj.weight`),
then `silu(gate) * up`, all in float32; the result `[T, I]` in `x.dtype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_up(x: jax.Array, w: jax.Array) -> jax.Array:
    """`silu(x @ w[0].T) * (x @ w[1].T)` computed in float32, returned in `x.dtype`."""
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    gate = jnp.einsum("th,ih->ti", x32, w32[0], precision=hp)
    up = jnp.einsum("th,ih->ti", x32, w32[1], precision=hp)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
