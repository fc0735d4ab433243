"""Helpers shared by the Pallas GPU kernels with the Triton lowering: masked loads and
stores across the two `pallas.triton` signatures JAX has shipped (an index argument, or
a ref already indexed), and compiler parameters by whichever class the installed JAX
names."""

from __future__ import annotations

import inspect

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


def compiler_params(num_warps: int, num_stages: int):
    """Triton's warps and pipeline stages, as this JAX takes them."""
    cls = getattr(plt, "CompilerParams", None) or getattr(pl, "TritonCompilerParams", None)
    if cls is not None:
        return cls(num_warps=num_warps, num_stages=num_stages)
    return dict(triton=dict(num_warps=num_warps, num_stages=num_stages))
