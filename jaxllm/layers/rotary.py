"""Rotary position embedding (RoPE), "rotate half" layout, as Hugging Face Llama applies it.

Positions are absolute token positions `[T]`, so one call serves a ragged batch
of prefill chunks and decodes. The inverse frequencies depend only on the
config and are computed once on the host (float64, then float32) and folded
into the compiled step as a constant; angles, cos and sin are float32.

Rope parameters are read as transformers 5 stores them (`config.rope_parameters`,
a dict holding `rope_type`, `rope_theta` and the scaling keys); configs in the
older form (`rope_theta` plus `rope_scaling`) are read too, and so is the
per-layer-type form (Gemma 3: `{"sliding_attention": {...}, "full_attention":
{...}}`, each layer reading its type's). Supported types:
"default", "linear" and "llama3" (Llama 3.1's frequency-dependent scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import ParameterError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The flat rope parameter dict of `hf_config` (for a layer of `layer_type` where
    the parameters are given per layer type), with `rope_type` and `rope_theta` set."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        if getattr(hf_config, "rope_theta", None) is not None:
            params.setdefault("rope_theta", hf_config.rope_theta)
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        if layer_type not in params:
            raise ParameterError("rope_parameters", f"no rope parameters for layer type "
                                 f"{layer_type!r}; the config has {sorted(params)}")
        params = dict(params[layer_type])
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", 10000.0)
    if getattr(hf_config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", hf_config.partial_rotary_factor)
    return params


@dataclass(frozen=True)
class RotaryEmbedding:
    """Static RoPE settings; hashable so it can live in a module's static graph."""

    head_dim: int
    rotary_dim: int
    inv_freq: tuple[float, ...]  # [rotary_dim // 2]

    @classmethod
    def from_hf_config(cls, hf_config: Any, head_dim: int,
                       layer_type: str | None = None) -> RotaryEmbedding:
        params = rope_parameters(hf_config, layer_type)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = _inv_freq(params, rotary_dim, hf_config)
        return cls(head_dim, rotary_dim, tuple(float(f) for f in inv_freq))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotates `x` `[T, num_heads, head_dim]` by the angles of `positions` `[T]`."""
        inv_freq = jnp.asarray(np.asarray(self.inv_freq, np.float32))
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, rd/2]
        cos = jnp.cos(angles)[:, None, :]
        sin = jnp.sin(angles)[:, None, :]
        half = self.rotary_dim // 2
        xf = x.astype(jnp.float32)
        x1, x2 = xf[..., :half], xf[..., half:self.rotary_dim]
        rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            rotated.append(xf[..., self.rotary_dim:])
        return jnp.concatenate(rotated, axis=-1).astype(x.dtype)


def _inv_freq(params: dict[str, Any], rotary_dim: int, hf_config: Any) -> np.ndarray:
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params, hf_config)
    raise ParameterError("rope_parameters",
                         f"rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_scaling(inv_freq: np.ndarray, params: dict[str, Any], hf_config: Any) -> np.ndarray:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_len = float(params.get("original_max_position_embeddings")
                    or hf_config.max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, out)
