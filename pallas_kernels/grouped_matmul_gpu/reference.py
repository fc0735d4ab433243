"""The grouped matmul in plain jnp: the oracle for `gpu.py`.

`out[r] = lhs[r] @ rhs[g(r)].T` for `lhs [M, K]` rows sorted by group, `rhs [G, N, K]`
and `group_sizes [G]`; rows past `sum(group_sizes)` come back zero. Every group is
multiplied with every row and the row's own group kept (G times the work: tests only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`[M, N]` float32, computed in float32 at full precision."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])
    group = jnp.searchsorted(ends, rows, side="right")  # G for rows past the sum
    every = jnp.einsum("mk,gnk->gmn", lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    own = jnp.take_along_axis(every, jnp.minimum(group, rhs.shape[0] - 1)[None, :, None],
                              axis=0)[0]
    return jnp.where((group < rhs.shape[0])[:, None], own, 0.0)
