"""The gated activation between a routed expert's gate/up and down products (layers/moe.py):
SwiGLU, `silu(gate) * up`, for most families, and GPT-OSS's clamped form of it.

GPT-OSS (transformers' `GptOssExperts._apply_gate`, vLLM's `swigluoai_and_mul`):
`gate = min(gate, limit)`, `up = clip(up, -limit, limit)`, then
`(up + 1) * gate * sigmoid(alpha * gate)`. With `alpha = 1`, no limit and no offset
that is SwiGLU, so one dataclass says both.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ExpertGLU:
    """`glu(h)`: `h [rows, 2 * I]`, the gate's `I` columns then the up's, to `[rows, I]`.
    Hashable: it lives in the layer's static graph."""

    alpha: float = 1.0  # the sigmoid's gain on the gate
    limit: float | None = None  # the clamp on gate (above) and up (both sides); None: none
    up_offset: float = 0.0  # added to up before the product (GPT-OSS: 1)

    def __call__(self, h: jax.Array) -> jax.Array:
        inter = h.shape[-1] // 2
        gate, up = h[..., :inter], h[..., inter:]
        if self == SWIGLU:
            return jax.nn.silu(gate) * up
        if self.limit is not None:
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
        return (up + self.up_offset) * (gate * jax.nn.sigmoid(self.alpha * gate))


SWIGLU = ExpertGLU()
