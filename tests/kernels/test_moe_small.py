"""The fused small-step expert kernels (pallas_kernels/moe_small), in Pallas interpret mode
on the CPU: `routed_expert_ffn`'s loop values over decode-sized steps, padding rows zero
whatever they hold, other devices' experts contributing nothing, and the Triton lowering
for CUDA accepting them."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.moe import routed_expert_ffn, routed_expert_kernel, routed_slots
from pallas_kernels.moe_small import gpu, reference
from tests.layers.test_moe import _draw

# Row counts of decode steps (one token, a few, a full 16-row tile), top 1 / 2 / 8 of 8
# experts, and 4 experts under 16 rows (most experts shared by several rows).
CASES = [(1, 8, 1, 1), (1, 8, 8, 1), (3, 8, 2, 2), (16, 4, 2, 16), (16, 8, 8, 13)]


def _step(t, e, k, n, h=32, i=48, dtype=np.float32):
    """A step's inputs with NaN in its padding rows (from `n` on)."""
    x, weights, ids, gate_up, down = _draw(t=t, e=e, k=k, h=h, i=i, seed=10 * t + k)
    x[n:] = np.nan
    return (jnp.asarray(x, dtype), weights, ids, jnp.asarray(gate_up, dtype),
            jnp.asarray(down, dtype))


def _kernel(*args, first=0, n=None):
    return np.asarray(jax.jit(lambda *a: routed_expert_kernel(
        *a, first_expert=first, num_tokens=n, interpret=True))(*args))


def _loop(*args, first=0, n=None):
    return np.asarray(jax.jit(lambda *a: routed_expert_ffn(
        *a, first_expert=first, num_tokens=n))(*args))


@pytest.mark.parametrize("t,e,k,n", CASES)
def test_kernel_equals_the_routed_loop_and_zeroes_padding_rows(t, e, k, n):
    args = _step(t, e, k, n)
    got, want = _kernel(*args, n=n), _loop(*args, n=n)
    assert np.abs(want[:n]).max() > 0.5
    np.testing.assert_allclose(got[:n], want[:n], rtol=0, atol=1e-5)
    assert got.shape == want.shape and not got[n:].any()


@pytest.mark.parametrize("t,k", [(1, 8), (16, 2)])
def test_bfloat16_kernel_is_within_rounding_of_the_bfloat16_loop(t, k):
    """Both round gate/up to bf16 before SiLU; the kernel keeps down's product in float32
    where the loop rounds it to bf16 first, so they differ by about one bf16 rounding
    (2^-8 relative) of each expert's output."""
    n = t - 1 if t > 1 else 1
    args = _step(t, 8, k, n, dtype=jnp.bfloat16)
    got, want = _kernel(*args, n=n), _loop(*args, n=n)
    x, weights, ids, gate_up, down = args
    f32 = [np.asarray(a, np.float32) for a in (x, gate_up, down)]
    exact = _loop(f32[0], weights, ids, *f32[1:], n=n)
    scale = np.abs(want[:n]).max()
    assert scale > 0.5
    assert np.abs(got[:n] - want[:n]).max() <= 2 ** -7 * scale
    # Neither strays further from the float32 result than the other does.
    assert np.abs(got[:n] - exact[:n]).max() <= 2 * np.abs(want[:n] - exact[:n]).max() + 1e-3
    assert not got[n:].any()


def test_each_device_computes_only_its_own_experts_pairs():
    """`first_expert`: the halves of 8 experts (4 per device) each give the loop's partial
    sums, and together the whole result."""
    x, weights, ids, gate_up, down = _step(8, 8, 3, 7)
    halves = []
    for s in (0, 4):
        part = (x, weights, ids, gate_up[s:s + 4], down[s:s + 4])
        got = _kernel(*part, first=s, n=7)
        np.testing.assert_allclose(got, _loop(*part, first=s, n=7), rtol=0, atol=1e-5)
        assert np.abs(got).max() > 0.1
        halves.append(got)
    np.testing.assert_allclose(halves[0] + halves[1], _loop(x, weights, ids, gate_up, down,
                                                            n=7), rtol=0, atol=1e-5)


def test_several_chunks_per_product_equal_the_reference():
    """Block sizes below H and I (4 gate/up chunks, 3 down chunks, several column blocks)
    and the slots shared unevenly by 4 down programs per block give `reference.py`'s
    values, fill slots past `count` included."""
    t, n = 5, 4
    x, weights, ids, gate_up, down = _step(t, 8, 2, n, h=64, i=48)
    slots = routed_slots(weights, ids, 0, 8, n)
    assert int(slots[1]) < slots[0].shape[0]  # some fill slots
    bs = gpu.BlockSizes(block_n=16, block_k=16, block_h=16, block_k_down=16, down_splits=4)
    assert int(slots[1]) % 4  # uneven shares, one split empty
    got = np.asarray(jax.jit(lambda *a: gpu.moe_small(*a, block_sizes=bs, interpret=True))(
        x, gate_up, down, *slots))
    want = np.asarray(reference.moe_small(x, gate_up, down, *slots))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[:n], _loop(x, weights, ids, gate_up, down, n=n)[:n],
                               rtol=0, atol=1e-5)
    assert not got[n:].any()


def test_sizes_off_the_tile_grid_are_refused():
    """H or I not a multiple of 16 (the layer keeps the loop for those), weights past
    int32 element offsets, or more rows than a program's tile holds."""
    assert gpu.supported(128, 2048, 768) and gpu.supported(128, 2048, 768, gpu.MAX_ROWS)
    assert not gpu.supported(128, 2048, 768, gpu.MAX_ROWS + 1)
    assert not gpu.supported(8, 32, 40) and not gpu.supported(8, 40, 32)
    assert not gpu.supported(512, 4096, 1 << 20)
    with pytest.raises(ValueError, match="multiples of 16"):
        gpu.default_block_sizes(32, 40)
    x, weights, ids, gate_up, down = _step(1, 8, 2, 1)
    bs = dataclasses.replace(gpu.default_block_sizes(32, 48), block_n=32)
    with pytest.raises(ValueError, match="block_n=32 must be a power of two .* dividing 48"):
        gpu.moe_small(x, gate_up, down, *routed_slots(weights, ids, 0, 8), block_sizes=bs)


@pytest.mark.parametrize("t,dtype", [(1, jnp.bfloat16), (16, jnp.bfloat16), (4, jnp.float32)])
def test_kernels_lower_to_triton_for_cuda(t, dtype):
    """The Qwen3-30B-A3B layer shape (128 experts, top 8, H 2048, I 768) lowers for CUDA
    on this CPU host: two Triton calls, no while loop around them."""
    e, h, i = 128, 2048, 768
    u = min(t * 8, e)
    shapes = (jax.ShapeDtypeStruct((t, h), dtype), jax.ShapeDtypeStruct((e, 2, i, h), dtype),
              jax.ShapeDtypeStruct((e, h, i), dtype), jax.ShapeDtypeStruct((u,), jnp.int32),
              jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((u, t), jnp.float32),
              jax.ShapeDtypeStruct((u, t), jnp.bool_))
    text = jax.jit(gpu.moe_small).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 2
    assert "stablehlo.while" not in text


def test_the_layers_fused_path_lowers_for_cuda_without_a_loop():
    """`routed_expert_kernel` as the layer calls it (routing to slots, both kernels, the
    split sum) at the Qwen3-30B-A3B shape, 16 rows: no while loop in the program."""
    t, k, e, h, i = 16, 8, 128, 2048, 768
    shapes = (jax.ShapeDtypeStruct((t, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32),
              jax.ShapeDtypeStruct((e, 2, i, h), jnp.bfloat16),
              jax.ShapeDtypeStruct((e, h, i), jnp.bfloat16),
              jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    text = jax.jit(routed_expert_kernel).trace(*shapes).lower(
        lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 2
    assert "stablehlo.while" not in text
