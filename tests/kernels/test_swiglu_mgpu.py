"""The fused SwiGLU up-projection kernel agrees with the jnp reference.

Where it runs: on the CPU in Mosaic GPU interpret mode (shared memory, TMA
copies and the producer / consumer barriers are simulated; the wgmma matmuls
become plain dots); on a Hopper GPU the compiled kernel (tests/conftest.py
defaults JAX to the CPU: run with `JAX_PLATFORMS=cuda`). Anywhere else the
kernel tests skip; the XLA path of `jaxllm.layers.mlp.SwiGLU` is tested
everywhere.

Bounds against the reference (float32 math on the same inputs, rounded to the
output dtype): relative L2 error <= 1e-5 for float32 (interpret only) and
<= 5e-3 for bfloat16 (the kernel accumulates in float32 as the reference does,
so what differs is the summation order and one bf16 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.errors import ParameterError
from jaxllm.layers.mlp import MIN_KERNEL_TOKENS, SwiGLU, get_swiglu
from pallas_kernels.mosaic_gpu_util import kernel_mode
from pallas_kernels.swiglu import gpu_mgpu, reference

MODE = kernel_mode()
needs_kernel = pytest.mark.skipif(MODE is None or gpu_mgpu.plgpu is None,
                                  reason="needs the CPU (interpret mode) or a Hopper GPU")
B = gpu_mgpu.BlockSizes


def _inputs(t, h, i, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (t, h), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (2, i, h), jnp.float32) * h ** -0.5).astype(dtype)
    return x, w


def _rel_l2(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# (T, H, I, dtype, block sizes): several output tiles per CTA (the persistent walk
# and the planar snake), K steps beyond the pipeline depth, both snake orientations.
CASES = {
    "f32-one-tile": (256, 64, 64, jnp.float32, {}),
    "f32-snake-n": (512, 256, 256, jnp.float32, dict(num_stages=2, grid_tile_width=2)),
    "f32-snake-m": (768, 128, 192, jnp.float32, dict(num_stages=3, grid_minor_n=False,
                                                    grid_tile_width=2)),
    "bf16-small-m": (256, 192, 128, jnp.bfloat16, dict(block_m=64, num_stages=2)),
    "bf16": (512, 128, 256, jnp.bfloat16, {}),
}


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_kernel_matches_reference(case):
    t, h, i, dtype, kw = CASES[case]
    if MODE == "device" and dtype == jnp.float32:
        pytest.skip("float32 is interpret-only (the tensor cores would take it as tf32)")
    x, w = _inputs(t, h, i, dtype, seed=len(case))
    bs = B(**kw)
    assert gpu_mgpu.supported(x, w, interpret=MODE == "interpret", block_sizes=bs)
    got = jax.jit(lambda x, w: gpu_mgpu.swiglu_up(x, w, interpret=MODE == "interpret",
                                                  block_sizes=bs))(x, w)
    want = reference.swiglu_up(x, w)
    assert got.shape == (t, i) and got.dtype == dtype
    assert _rel_l2(got, want) <= (1e-5 if dtype == jnp.float32 else 5e-3)
    # Gate and up are not interchangeable: the swapped product is far off.
    assert _rel_l2(got, reference.swiglu_up(x, w[::-1])) > 0.5


@pytest.mark.skipif(MODE != "device", reason="a model-sized shape: Hopper only")
def test_default_tiling_on_device_at_a_model_shape():
    x, w = _inputs(2048, 1024, 3584, jnp.bfloat16)
    got = jax.jit(gpu_mgpu.swiglu_up)(x, w)
    assert _rel_l2(got, reference.swiglu_up(x, w)) <= 5e-3


def test_supported_names_what_the_kernel_does_not_cover():
    x, w = _inputs(256, 64, 128, jnp.float32)
    interp = dict(interpret=True, block_sizes=B())
    ok = gpu_mgpu.plgpu is not None
    assert gpu_mgpu.supported(x, w, **interp) is ok
    assert not gpu_mgpu.supported(x[:200], w, **interp)  # T not a multiple of 2 x block_m
    assert not gpu_mgpu.supported(x, w[:, :96], **interp)  # I not a multiple of block_n
    assert not gpu_mgpu.supported(x[:, :48], w[:, :, :48], **interp)  # H % block_k
    assert not gpu_mgpu.supported(x, w.astype(jnp.bfloat16), **interp)  # mixed dtypes
    assert not gpu_mgpu.supported(x, w[:1], **interp)  # not a gate/up pair
    assert not gpu_mgpu.supported(x, w, interpret=False)  # float32 is interpret-only
    with pytest.raises(ValueError, match="not covered"):
        gpu_mgpu.swiglu_up(x[:200], w, **interp)


@pytest.mark.parametrize("bias", [False, True])
def test_xla_path_matches_reference(bias):
    x, w = _inputs(40, 64, 96, jnp.float32)
    b = jax.random.normal(jax.random.key(3), (2, 96), jnp.float32) if bias else None
    got = SwiGLU()(x, w, b)
    gate_up = np.einsum("th,sih->tsi", np.asarray(x, np.float64), np.asarray(w, np.float64))
    if bias:
        gate_up = gate_up + np.asarray(b, np.float64)
    g, u = gate_up[:, 0], gate_up[:, 1]
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.slow
def test_swiglu_takes_the_kernel_only_where_it_fits(monkeypatch):
    calls = []
    real = gpu_mgpu.swiglu_up

    def counting(x, w, **kw):
        calls.append(x.shape)
        return real(x, w, **kw)

    monkeypatch.setattr(gpu_mgpu, "swiglu_up", counting)
    interpret = MODE == "interpret"
    f = SwiGLU("pallas_gpu_mosaic", kernel=True, interpret=interpret)
    dtype = jnp.float32 if interpret else jnp.bfloat16
    x, w = _inputs(256, 64, 128, dtype)
    want = reference.swiglu_up(x, w)
    assert _rel_l2(f(x, w), want) <= (1e-5 if interpret else 5e-3)
    assert calls == [(256, 64)]
    f(x[:100], w)  # T not covered: XLA
    f(x, w, jnp.zeros((2, 128), dtype))  # biased: XLA
    SwiGLU("auto", kernel=True, interpret=interpret, min_tokens=512)(x, w)  # below the threshold
    assert calls == [(256, 64)]


def test_get_swiglu_by_name():
    assert get_swiglu("xla") == SwiGLU()
    with pytest.raises(ParameterError, match="mlp_backend"):
        get_swiglu("cublas")
    auto = get_swiglu("auto", dtype=jnp.bfloat16)
    hopper = gpu_mgpu.plgpu is not None and gpu_mgpu._is_hopper()
    assert auto.kernel is hopper and auto.min_tokens == (MIN_KERNEL_TOKENS if hopper else 0)
    assert not get_swiglu("auto", dtype=jnp.float32).kernel
    if not hopper:
        with pytest.raises(ParameterError, match="Hopper"):
            get_swiglu("pallas_gpu_mosaic")
    explicit = get_swiglu("pallas_gpu_mosaic", interpret=True)
    assert (explicit.kernel, explicit.interpret, explicit.min_tokens) == (True, True, 0)


@needs_kernel
@pytest.mark.slow
def test_swiglu_traces_the_kernel_once_for_every_layer(monkeypatch):
    """Layers of one step call the kernel with the same shapes: one nested program,
    traced and compiled once (32 separate call sites cost 28 s on the H100, one 1.3 s)."""
    calls = []
    real = gpu_mgpu.swiglu_up
    monkeypatch.setattr(gpu_mgpu, "swiglu_up",
                        lambda x, w, **kw: calls.append(x.shape) or real(x, w, **kw))
    interpret = MODE == "interpret"
    f = SwiGLU("pallas_gpu_mosaic", kernel=True, interpret=interpret)
    dtype = jnp.float32 if interpret else jnp.bfloat16
    x, w = _inputs(256, 64, 128, dtype)
    layers = jax.jit(lambda x, w: [f(x * (i + 1), w) for i in range(3)])
    outs = layers(x, w)
    assert calls == [(256, 64)]
    for i, out in enumerate(outs):
        assert _rel_l2(out, reference.swiglu_up(x * (i + 1), w)) <= (1e-5 if interpret else 5e-3)
