"""Helpers shared by the Pallas GPU kernels with the Triton lowering: masked loads and
stores across the two `pallas.triton` signatures JAX has shipped (an index argument, or
a ref already indexed), a float32 `a @ b.T`, and compiler parameters by whichever class
the installed JAX names."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_LOAD_TAKES_IDX = "idx" in inspect.signature(plt.load).parameters


def load(ref, idx, *, mask=None, other=None, eviction_policy=None):
    """`ref[idx]`, lanes outside `mask` read as `other`."""
    if _LOAD_TAKES_IDX:
        return plt.load(ref, idx, mask=mask, other=other, eviction_policy=eviction_policy)
    return plt.load(ref.at[idx], mask=mask, other=other, eviction_policy=eviction_policy)


def store(ref, idx, val, *, mask=None):
    """`ref[idx] = val` on the lanes inside `mask`."""
    if _LOAD_TAKES_IDX:
        return plt.store(ref, idx, val, mask=mask)
    return plt.store(ref.at[idx], val, mask=mask)


def dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b.T` in float32 (float32 operands at full precision, not TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def compiler_params(num_warps: int, num_stages: int):
    """Triton's warps and pipeline stages, as this JAX takes them."""
    cls = getattr(plt, "CompilerParams", None) or getattr(pl, "TritonCompilerParams", None)
    if cls is not None:
        return cls(num_warps=num_warps, num_stages=num_stages)
    return dict(triton=dict(num_warps=num_warps, num_stages=num_stages))
