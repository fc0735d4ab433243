"""scripts/bench_tp_decode.py: the synthetic tensor-parallel step computes the same thing
whole, on row chunks, and without its psums at tp 1 (where a psum is the identity)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from scripts.bench_tp_decode import SHAPE_SMALL, step_program


def _run(tp: int, with_psum: bool, chunks: int) -> np.ndarray:
    mesh = Mesh(np.asarray(jax.devices()[:tp]), ("model",))
    fn, x, w = step_program(SHAPE_SMALL, mesh, 8, with_psum, chunks)
    # distinct rows, so a chunk put back in the wrong place shows
    x = jax.random.normal(jax.random.key(0), x.shape, x.dtype)
    return np.asarray(fn(x, w), np.float32)


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_step_equals_the_whole_step(tp):
    whole = _run(tp, True, 1)
    assert np.isfinite(whole).all()
    assert np.abs(whole - whole[::-1]).max() > 1e-2  # rows differ
    np.testing.assert_allclose(_run(tp, True, 2), whole, rtol=2e-2, atol=2e-2)


def test_psums_matter_only_across_shards():
    np.testing.assert_allclose(_run(1, False, 1), _run(1, True, 1))
    assert np.abs(_run(2, False, 1) - _run(2, True, 1)).max() > 1e-3
