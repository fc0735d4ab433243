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
"default", "linear", "llama3" (Llama 3.1's frequency-dependent scaling), "yarn"
(frequencies blended between interpolation and extrapolation by a ramp over the
dimensions) and "longrope" (Phi-3's per-dimension rescale factors). The last two
also scale cos and sin by an attention factor, as transformers does.

LongRoPE has a short and a long factor set. transformers switches between them by
each forward's longest position, so keys already cached keep the set they were
rotated with; like vLLM, the engine fixes one set for its whole run: the long set
when `max_model_len` passes `original_max_position_embeddings`, else the short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import ParameterError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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
    scale: float = 1.0  # cos and sin times this (yarn's and longrope's attention factor)

    @classmethod
    def from_hf_config(cls, hf_config: Any, head_dim: int, layer_type: str | None = None,
                       max_model_len: int | None = None) -> RotaryEmbedding:
        """`max_model_len` picks longrope's factor set (the model's context if None)."""
        params = rope_parameters(hf_config, layer_type)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        max_len = max_model_len or int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        inv_freq, scale = _inv_freq(params, rotary_dim, hf_config, max_len)
        return cls(head_dim, rotary_dim, tuple(float(f) for f in inv_freq), float(scale))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotates `x` `[T, num_heads, head_dim]` by the angles of `positions` `[T]`."""
        inv_freq = jnp.asarray(np.asarray(self.inv_freq, np.float32))
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, rd/2]
        cos = jnp.cos(angles)[:, None, :]
        sin = jnp.sin(angles)[:, None, :]
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        half = self.rotary_dim // 2
        xf = x.astype(jnp.float32)
        x1, x2 = xf[..., :half], xf[..., half:self.rotary_dim]
        rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            rotated.append(xf[..., self.rotary_dim:])
        return jnp.concatenate(rotated, axis=-1).astype(x.dtype)


def _inv_freq(params: dict[str, Any], rotary_dim: int, hf_config: Any,
              max_len: int) -> tuple[np.ndarray, float]:
    """The inverse frequencies and the factor on cos and sin."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params, hf_config), 1.0
    if rope_type == "yarn":
        return _yarn_scaling(inv_freq, params, rotary_dim, base, hf_config)
    if rope_type == "longrope":
        return _longrope_scaling(inv_freq, params, rotary_dim, hf_config, max_len)
    raise ParameterError("rope_parameters",
                         f"rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _original_len(params: dict[str, Any], hf_config: Any) -> float:
    return float(params.get("original_max_position_embeddings")
                 or getattr(hf_config, "original_max_position_embeddings", None)
                 or hf_config.max_position_embeddings)


def _factor(params: dict[str, Any], hf_config: Any, old_len: float) -> float:
    """The context scale: the config's `factor`, else the context over the original one."""
    factor = params.get("factor")
    return float(factor) if factor is not None else hf_config.max_position_embeddings / old_len


def _yarn_scaling(inv_freq: np.ndarray, params: dict[str, Any], rotary_dim: int,
                  base: float, hf_config: Any) -> tuple[np.ndarray, float]:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original context
    are interpolated (divided by `factor`), those that turn more than `beta_fast` times
    kept, a linear ramp between; cos and sin scale by `0.1 ln(factor) + 1` (or the ratio
    of two such terms with `mscale` / `mscale_all_dim`, or `attention_factor` as given)."""
    old_len = _original_len(params, hf_config)
    factor = _factor(params, hf_config, old_len)

    scale = params.get("attention_factor")
    if scale is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                 else yarn_mscale(factor))

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each dimension's original frequency
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(scale)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude term `0.1 m ln(factor) + 1` (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _longrope_scaling(inv_freq: np.ndarray, params: dict[str, Any], rotary_dim: int,
                      hf_config: Any, max_len: int) -> tuple[np.ndarray, float]:
    """LongRoPE: each dimension's frequency divided by its factor from the long set when
    the engine's context passes the original one, else the short set; cos and sin scale
    by `sqrt(1 + ln(factor) / ln(original context))` (or `attention_factor`)."""
    old_len = _original_len(params, hf_config)
    factor = _factor(params, hf_config, old_len)
    key = "long_factor" if max_len > old_len else "short_factor"
    ext = np.asarray(params[key], np.float64)
    if ext.shape != (rotary_dim // 2,):
        raise ParameterError(f"rope_parameters.{key}",
                             f"has {ext.size} entries; the rotary dimension {rotary_dim} "
                             f"needs {rotary_dim // 2}")
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return inv_freq / ext, float(scale)


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
