"""The residual-add projection kernel agrees with the jnp reference.

It runs where the SwiGLU kernel's tests run (test_swiglu_mgpu.py): Mosaic GPU
interpret mode on the CPU, the compiled kernel on a Hopper GPU with
`JAX_PLATFORMS=cuda`, and skips elsewhere; `MatmulAdd`'s XLA path is tested
everywhere. The error bounds are that file's too: relative L2 <= 1e-5 for
float32 (interpret only), <= 5e-3 for bfloat16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.mlp import MatmulAdd, SwiGLU
from pallas_kernels.matmul_add import gpu_mgpu, reference
from pallas_kernels.mosaic_gpu_util import kernel_mode, plgpu

MODE = kernel_mode()
needs_kernel = pytest.mark.skipif(MODE is None or plgpu is None,
                                  reason="needs the CPU (interpret mode) or a Hopper GPU")
B = gpu_mgpu.BlockSizes


def _inputs(t, k, n, dtype, seed=0):
    kx, kw, kr = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    r = jax.random.normal(kr, (t, n), jnp.float32).astype(dtype)
    return x, w, r


def _rel_l2(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# (T, K, N, dtype, block sizes): several output tiles per CTA (the persistent walk,
# the planar snake, and the residual buffer reused from one tile to the next), K
# steps beyond the pipeline depth, both snake orientations, N not a multiple of 128.
CASES = {
    "f32-one-tile": (256, 64, 128, jnp.float32, None),
    "f32-snake-n": (512, 256, 256, jnp.float32, B(num_stages=2, grid_tile_width=2)),
    "f32-snake-m": (768, 128, 384, jnp.float32, B(grid_minor_n=False, grid_tile_width=2)),
    "f32-n64": (512, 192, 192, jnp.float32, None),
    "bf16-small-m": (256, 192, 128, jnp.bfloat16, B(block_m=64, num_stages=2)),
    "bf16": (512, 128, 256, jnp.bfloat16, None),
}


# float32 is interpret-only (the tensor cores would take it as tf32).
RUNNABLE = [c for c, spec in CASES.items() if MODE != "device" or spec[3] != jnp.float32]


@needs_kernel
@pytest.mark.parametrize("case", RUNNABLE)
@pytest.mark.slow
def test_kernel_matches_reference(case):
    t, k, n, dtype, bs = CASES[case]
    interpret = MODE == "interpret"
    x, w, r = _inputs(t, k, n, dtype, seed=len(case))
    assert gpu_mgpu.supported(x, w, r, interpret=interpret, block_sizes=bs)
    got = jax.jit(lambda x, w, r: gpu_mgpu.matmul_add(x, w, r, interpret=interpret,
                                                      block_sizes=bs))(x, w, r)
    want = reference.matmul_add(x, w, r)
    assert got.shape == (t, n) and got.dtype == dtype
    assert _rel_l2(got, want) <= (1e-5 if dtype == jnp.float32 else 5e-3)
    # Each tile takes its own residual rows: another tile's, or none, is far off.
    assert _rel_l2(got, reference.matmul_add(x, w, jnp.roll(r, 128, axis=0))) > 0.5
    assert _rel_l2(got, reference.matmul_add(x, w, jnp.zeros_like(r))) > 0.5


@pytest.mark.skipif(MODE != "device", reason="model-sized shapes: Hopper only")
@pytest.mark.parametrize("k", [4096, 14336])
def test_default_tiling_on_device_at_the_8b_shapes(k):
    x, w, r = _inputs(2048, k, 4096, jnp.bfloat16)
    got = jax.jit(gpu_mgpu.matmul_add)(x, w, r)
    assert _rel_l2(got, reference.matmul_add(x, w, r)) <= 5e-3


def test_supported_names_what_the_kernel_does_not_cover():
    x, w, r = _inputs(256, 64, 128, jnp.float32)
    ok = plgpu is not None
    assert gpu_mgpu.supported(x, w, r, interpret=True) is ok
    assert not gpu_mgpu.supported(x[:200], w, r[:200], interpret=True)  # T % 256
    assert not gpu_mgpu.supported(x, w[:96], r[:, :96], interpret=True)  # N % 64
    assert not gpu_mgpu.supported(x[:, :48], w[:, :48], r, interpret=True)  # K % 64
    assert not gpu_mgpu.supported(x, w, r[:, :64], interpret=True)  # residual shape
    assert not gpu_mgpu.supported(x, w, r.astype(jnp.bfloat16), interpret=True)  # dtypes
    assert not gpu_mgpu.supported(x, w[None], r, interpret=True)  # w not [N, K]
    assert not gpu_mgpu.supported(x, w, r, interpret=False)  # float32 is interpret-only
    with pytest.raises(ValueError, match="not covered"):
        gpu_mgpu.matmul_add(x[:200], w, r[:200], interpret=True)


@pytest.mark.parametrize("bias", [False, True])
def test_xla_path_matches_reference(bias):
    x, w, r = _inputs(40, 64, 96, jnp.float32)
    b = jax.random.normal(jax.random.key(3), (96,), jnp.float32) if bias else None
    got = MatmulAdd()(x, w, r, b)
    want = np.asarray(r, np.float64) + np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if bias:
        want = want + np.asarray(b, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.slow
def test_matmul_add_takes_the_kernel_only_where_it_fits(monkeypatch):
    calls = []
    real = gpu_mgpu.matmul_add
    monkeypatch.setattr(gpu_mgpu, "matmul_add",
                        lambda x, w, r, **kw: calls.append(x.shape) or real(x, w, r, **kw))
    interpret = MODE == "interpret"
    dtype = jnp.float32 if interpret else jnp.bfloat16
    x, w, r = _inputs(256, 64, 128, dtype)
    f = MatmulAdd(kernel=True, interpret=interpret)
    assert _rel_l2(f(x, w, r), reference.matmul_add(x, w, r)) <= (1e-5 if interpret else 5e-3)
    assert calls == [(256, 64)]
    f(x[:100], w, r[:100])  # T not covered: XLA
    f(x, w, r, jnp.zeros((128,), dtype))  # biased: XLA
    MatmulAdd(kernel=True, interpret=interpret, min_tokens=512)(x, w, r)  # below the floor
    assert calls == [(256, 64)]


def test_only_the_explicit_mosaic_backend_sends_the_residual_projections_to_the_kernel():
    assert SwiGLU().matmul_add == MatmulAdd()
    # "auto" (the kernel for SwiGLU) leaves them to XLA: no gain measured end to end.
    assert not SwiGLU("auto", kernel=True, min_tokens=2048).matmul_add.kernel
    explicit = SwiGLU("pallas_gpu_mosaic", kernel=True, interpret=True)
    assert explicit.matmul_add == MatmulAdd(kernel=True, interpret=True, min_tokens=0)
    # Split over 'model' the projections are row parallel: XLA sums them before the add.
    split = SwiGLU("pallas_gpu_mosaic", kernel=True, mesh=object())
    assert not split.matmul_add.kernel
