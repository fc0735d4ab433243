"""The small-step routed experts in plain jnp: the oracle for `gpu.py`, with its contract
(experts reduced to slots; see that module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def moe_small(x: jax.Array, gate_up: jax.Array, down: jax.Array, experts: jax.Array,
              count: jax.Array, slot_weights: jax.Array, slot_mask: jax.Array) -> jax.Array:
    """`gpu.moe_small`'s result: every slot's expert applied to every row (its weights
    gathered), kept where the row routed there and the slot is below `count`, in float32."""
    e = jnp.minimum(experts, gate_up.shape[0] - 1)  # fill slots: any expert, dropped below
    hp = jax.lax.Precision.HIGHEST
    gate = jnp.einsum("th,uih->uti", x, gate_up[e, 0], precision=hp,
                      preferred_element_type=jnp.float32).astype(x.dtype)
    up = jnp.einsum("th,uih->uti", x, gate_up[e, 1], precision=hp,
                    preferred_element_type=jnp.float32).astype(x.dtype)
    h = jax.nn.silu(gate) * up
    y = jnp.einsum("uti,uhi->uth", h, down[e], precision=hp,
                   preferred_element_type=jnp.float32)
    keep = slot_mask & (jnp.arange(experts.shape[0]) < count)[:, None]
    return jnp.sum(jnp.where(keep[..., None], y * slot_weights[..., None], 0.0), axis=0)
