"""How many parameters a model state holds, and how many bytes its weights take as stored:
what a roofline reads (benchmarks) and what an engine core reports of its model."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def param_count(state: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))


def weight_bytes(state: Any) -> int:
    """Bytes of every weight as held: a quantized projection counts 1 byte per element
    plus its float32 per-channel scales."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(state)))
