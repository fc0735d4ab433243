"""Matrix products at the model's precision.

JAX multiplies float32 operands in TF32 on NVIDIA GPUs and in one bfloat16 pass on
TPUs unless told otherwise; PyTorch (so vLLM, and the transformers oracle) multiplies
them in float32. A float32 model therefore traces its products under
`jax.default_matmul_precision("highest")`; a bfloat16 model's programs are untouched
(its float32 side products, such as a router's, keep the fast default).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def products_at(dtype: Any) -> contextlib.AbstractContextManager:
    """The matmul precision a model of `dtype` traces its products under."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def at_model_precision(method: Callable) -> Callable:
    """A model method traced under `products_at(self.dtype)`."""

    @functools.wraps(method)
    def traced(self, *args: Any, **kw: Any) -> Any:
        with products_at(self.dtype):
            return method(self, *args, **kw)

    return traced
