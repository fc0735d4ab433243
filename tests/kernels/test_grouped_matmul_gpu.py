"""The Pallas GPU grouped matmul ("pallas_gpu", Pallas interpret mode on the CPU) equals the
"ragged_dot" body and the jnp reference on the rows inside the groups, and lowers for CUDA.

Bounds: float32 operands, max |err| <= 1e-5 against ragged_dot (both accumulate
float32 products at full precision, in different orders); bfloat16 operands and
output, at most one bfloat16 ulp of the reference (both round the same float32 sum
once). Quantized weights (int8, float8_e4m3fn) are upcast exactly, so they meet the
float32 bound against the reference over the upcast operands (1e-6 of the largest
output: float32 sums of exact products).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.layers.grouped_matmul import GroupedMatmul, default_grouped_matmul
from pallas_kernels.grouped_matmul_gpu import gpu, reference

RAGGED_DOT = GroupedMatmul("ragged_dot")


@dataclasses.dataclass(frozen=True)
class Case:
    sizes: tuple[int, ...]  # rows per group; their sum may be below m
    m: int
    k: int = 32
    n: int = 32
    max_rows: int = 128  # the largest row tile ("tiling"'s first entry)


CASES = {
    # Empty groups, groups larger than the 32-row tile, sizes not multiples of it,
    # 90 of 100 rows in groups.
    "m100-g4-empty-and-multi-tile-groups": Case((0, 37, 50, 3), 100, k=40, n=24),
    "m8-g8-one-row-groups": Case((1, 0, 2, 0, 0, 3, 0, 1), 8),
    "m1-g1": Case((1,), 1, k=16, n=16),
    "m1-g4-row-in-the-third-group": Case((0, 0, 1, 0), 1),
    # 16-row tiles: a group of six tiles and a partial one.
    "m100-g1-many-tiles": Case((100,), 100, max_rows=16),
    # Contraction and columns past whole blocks (16-row tiles: bk 128 in bf16, 64 in
    # float32; bn 128): masked tails.
    "m100-g8-k-and-n-tails": Case((20, 0, 13, 31, 1, 0, 17, 10), 100, k=200, n=150),
    # Full 128-row tiles (bn 256): a partial second column block.
    "m300-g2-128-row-tiles": Case((150, 140), 300, k=64, n=300),
}


def _operands(case: Case, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    lhs = rng.normal(size=(case.m, case.k)).astype(np.float32)
    lhs[sum(case.sizes):] = np.nan  # rows past the groups may hold anything
    # Scaled so outputs are about unit size whatever K (the bounds are absolute).
    rhs = (rng.normal(size=(len(case.sizes), case.n, case.k)) / np.sqrt(case.k)
           ).astype(np.float32)
    return (jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype),
            jnp.asarray(case.sizes, jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_pallas_gpu_body_equals_ragged_dot_on_the_rows_in_groups(name, dtype):
    case = CASES[name]
    lhs, rhs, sizes = _operands(case, dtype)
    body = GroupedMatmul("pallas_gpu", interpret=True, tiling=(case.max_rows, 128, 128))
    got = np.asarray(jax.jit(body)(lhs, rhs, sizes).astype(jnp.float32))
    want = np.asarray(jax.jit(RAGGED_DOT)(lhs, rhs, sizes).astype(jnp.float32))
    rows = sum(case.sizes)
    assert got.shape == (case.m, case.n)
    got, want = got[:rows], want[:rows]
    assert np.isfinite(got).all() and np.abs(want).max() > 1.0
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    else:
        exact = np.asarray(reference.grouped_matmul(lhs, rhs, sizes))[:rows]
        # One bfloat16 ulp (8 significant bits) at each exact value's magnitude.
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)
        assert (np.abs(got - exact) <= ulp).all()
        assert (np.abs(want - exact) <= ulp).all()  # the bound is ragged_dot's own


@pytest.mark.parametrize("lhs_dtype,rhs_dtype", [(jnp.bfloat16, jnp.int8),
                                                 (jnp.float32, jnp.int8),
                                                 (jnp.float8_e4m3fn, jnp.float8_e4m3fn)],
                         ids=["bf16-x-int8", "f32-x-int8", "fp8-x-fp8"])
def test_quantized_operands_are_upcast_exactly_in_the_kernel(lhs_dtype, rhs_dtype):
    """The quantized experts' operands, float32 result (as layers/quant.py asks)."""
    case = CASES["m100-g8-k-and-n-tails"]
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.normal(size=(case.m, case.k)), jnp.float32).astype(lhs_dtype)
    rhs = jnp.asarray(rng.integers(-127, 128, size=(len(case.sizes), case.n, case.k)),
                      jnp.float32).astype(rhs_dtype)
    sizes = jnp.asarray(case.sizes, jnp.int32)
    body = GroupedMatmul("pallas_gpu", interpret=True)
    got = np.asarray(jax.jit(lambda *a: body(*a, out_dtype=jnp.float32))(lhs, rhs, sizes))
    want = np.asarray(reference.grouped_matmul(lhs, rhs, sizes))
    rows = sum(case.sizes)
    scale = np.abs(want[:rows]).max()
    assert scale > 100
    np.testing.assert_allclose(got[:rows], want[:rows], rtol=0, atol=1e-6 * scale)


_TILES = jax.jit(gpu.tile_metadata, static_argnums=(1, 2))


@st.composite
def _groups(draw):
    """(group sizes, M, tm): G in {1, 4, 9}, M in {1, 50} (few shapes: each compiles),
    sizes cut from M at random points so their sum is at most M."""
    groups, m = draw(st.sampled_from([1, 4, 9])), draw(st.sampled_from([1, 50]))
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=groups, max_size=groups)))
    return np.diff([0, *cuts]).astype(np.int32), m, draw(st.sampled_from([16, 32]))


@settings(max_examples=60, deadline=None)
@given(case=_groups())
def test_tiles_cover_each_grouped_row_once_within_the_static_bound(case):
    """Every row inside the groups lies in exactly one tile of its own group, no tile
    holds more than `tm` rows or rows of another group, and the real tiles fit the
    static slot count `cdiv(M, tm) + min(G, M)`."""
    sizes, m, tm = case
    group, first, end = map(np.asarray, _TILES(jnp.asarray(sizes), m, tm))
    assert group.shape == (gpu.num_tiles(m, len(sizes), tm),)
    ends = np.cumsum(sizes)
    owner = np.searchsorted(ends, np.arange(m), side="right")
    covered = np.zeros(m, np.int32)
    for g, lo, hi in zip(group, first, end, strict=True):
        if g < 0:
            assert lo == hi
            continue
        assert 0 < hi - lo <= tm
        assert (owner[lo:hi] == g).all()
        covered[lo:hi] += 1
    np.testing.assert_array_equal(covered, (np.arange(m) < ends[-1]).astype(np.int32))


def test_pallas_gpu_body_lowers_to_a_triton_call_for_cuda():
    """Lowered for CUDA from this host (the Triton IR is built here; the device compiles
    it): the Qwen3-30B-A3B gate_up shapes in bfloat16 at 32- and 128-row tiles, and
    fp8 operands."""
    s = jax.ShapeDtypeStruct
    body = GroupedMatmul("pallas_gpu")
    for m, lhs_dtype, rhs_dtype in [(4096, jnp.bfloat16, jnp.bfloat16),
                                    (65536, jnp.bfloat16, jnp.bfloat16),
                                    (4096, jnp.float8_e4m3fn, jnp.float8_e4m3fn)]:
        traced = jax.jit(lambda *a: body(*a, out_dtype=jnp.float32)).trace(
            s((m, 2048), lhs_dtype), s((128, 1536, 2048), rhs_dtype),
            s((128,), jnp.int32))
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text and "grouped_matmul_gpu" in text


def test_moe_kernel_knob_selects_the_pallas_gpu_body(monkeypatch):
    monkeypatch.setenv("JAXLLM_MOE_KERNEL", "pallas_gpu")
    assert default_grouped_matmul().kernel == "pallas_gpu"


@pytest.mark.parametrize("field,sizes", [("tm", (8, 64, 64)), ("bn", (16, 96, 64)),
                                         ("bk", (16, 64, 0))])
def test_block_sizes_off_the_tensor_core_tile_are_an_error_naming_the_field(field, sizes):
    with pytest.raises(ValueError, match=f"{field}: must be a power of two >= 16"):
        gpu.BlockSizes(*sizes)


def test_weights_past_int32_offsets_take_ragged_dot_instead_of_the_kernel():
    s = jax.ShapeDtypeStruct
    small, huge = s((128, 1536, 2048), jnp.bfloat16), s((64, 16384, 2048), jnp.bfloat16)
    lhs = s((256, 2048), jnp.bfloat16)
    assert gpu.supported(lhs, small) and not gpu.supported(lhs, huge)
    body = GroupedMatmul("pallas_gpu", interpret=True)
    for rhs, kernel in ((small, "pallas_call"), (huge, "ragged_dot")):
        jaxpr = str(jax.make_jaxpr(body)(lhs, rhs, s((rhs.shape[0],), jnp.int32)))
        assert kernel in jaxpr and ({"pallas_call", "ragged_dot"} - {kernel}).pop() not in jaxpr
    with pytest.raises(ValueError, match="int32 offsets"):
        jax.make_jaxpr(functools.partial(gpu.grouped_matmul, interpret=True))(
            lhs, huge, s((64,), jnp.int32))
