"""The residual-add-with-RMSNorm kernel (pallas_kernels/add_rms_norm), in Pallas interpret
mode on the CPU: the sum and the norm `residual + x` and `rms_norm` give (Llama's and
Gemma's `1 + w` norms, float32 and bfloat16, hidden sizes on and off the powers of two),
and its lowering for CUDA; the GPU body takes it at small steps only."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.attention_pallas import PallasGPUBackend
from jaxllm.layers.norm import rms_norm
from pallas_kernels.add_rms_norm import gpu


@pytest.mark.parametrize("t,h,offset,dtype", [(1, 32, False, jnp.float32),
                                              (5, 48, True, jnp.float32),
                                              (3, 64, False, jnp.bfloat16),
                                              (2, 80, True, jnp.bfloat16)])
def test_kernel_gives_the_sum_and_the_norm_of_the_unfused_ops(t, h, offset, dtype):
    rng = np.random.default_rng(t * h)
    x = jnp.asarray(rng.normal(size=(t, h)), dtype)
    residual = jnp.asarray(3 * rng.normal(size=(t, h)), dtype)
    weight = jnp.asarray(rng.normal(size=(h,)), dtype)
    got_sum, got = gpu.add_rms_norm(x, residual, weight, eps=1e-6, offset=offset,
                                    interpret=True)
    want_sum = residual + x
    want = rms_norm(want_sum, weight, 1e-6, offset)
    assert got_sum.dtype == got.dtype == dtype and got.shape == (t, h)
    np.testing.assert_array_equal(np.asarray(got_sum), np.asarray(want_sum))
    # float32: the sum of squares in another order; bfloat16: at most one unit of the
    # last place where that moves a rounding.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **tol)
    assert np.abs(np.asarray(want, np.float32)).max() > 0.5


def test_mismatched_operands_are_refused():
    x = jnp.zeros((2, 32), jnp.float32)
    with pytest.raises(ValueError, match="must be"):
        gpu.add_rms_norm(x, x.astype(jnp.bfloat16), jnp.ones((32,)), eps=1e-6)
    with pytest.raises(ValueError, match="must be"):
        gpu.add_rms_norm(x, x, jnp.ones((16,)), eps=1e-6)


def test_kernel_lowers_to_one_triton_call_for_cuda():
    shapes = [jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)] * 2 + [
        jax.ShapeDtypeStruct((2048,), jnp.bfloat16)]
    fn = jax.jit(lambda x, r, w: gpu.add_rms_norm(x, r, w, eps=1e-6))
    text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1
    assert "stablehlo.reduce" not in text


def test_the_gpu_body_fuses_small_steps_only_unless_turned_off(monkeypatch):
    body = PallasGPUBackend(interpret=True)
    assert body.fuses_add_norm(1) and body.fuses_add_norm(16)
    assert not body.fuses_add_norm(17)
    monkeypatch.setenv("JAXLLM_ADD_NORM_KERNEL", "0")
    assert not body.fuses_add_norm(1)
