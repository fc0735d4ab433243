"""The Mosaic TPU attention kernel compiles for real TPUs, with no TPU attached.

Interpret mode (test_ragged_paged_attention.py) checks the kernel's arithmetic
but never runs the Mosaic compiler, which is what rejects a tile shape, an
unsupported op or a VMEM overflow on a chip. Here every configuration checked
in interpret mode, with the same shapes and block sizes, is lowered and
compiled by libtpu's TPU compiler against a compile-only v5e chip (and the
head_dim / dtype corners against v6e too), plus the engine's own default block
sizes at serving-sized buckets, where VMEM is tightest; with attention sinks (one
more VMEM block) too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.distributed.tpu_topology import libtpu_available, topology_devices
from pallas_kernels.ragged_paged_attention import tpu
from tests.kernels.test_ragged_paged_attention import CASES, SINK_CASES, Case, make_batch

pytestmark = pytest.mark.skipif(not libtpu_available(),
                                reason="libtpu (the TPU compiler) is not installed; "
                                       "pyproject's test extra installs it")


def compile_for_tpu(topology: str, case: Case, num_tokens: int, num_reqs: int, width: int,
                    num_pages: int, block_sizes: tpu.BlockSizes | None, sinks: bool = False):
    """The kernel lowered and compiled for one chip of `topology` at these shapes (with
    a float32 `[num_q_heads]` sinks operand where `sinks`)."""
    device = topology_devices(topology)[0]
    replicated = NamedSharding(Mesh([device], ("x",)), P())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    hkv, d = case.num_kv_heads, case.head_dim
    args = (spec((num_tokens, hkv * case.group, d), case.dtype),
            spec(tpu.kv_cache_shape(num_pages, case.page_size, hkv, d), case.dtype),
            spec((num_reqs,), jnp.int32), spec((num_reqs, width), jnp.int32),
            spec((num_reqs + 1,), jnp.int32), spec((1,), jnp.int32))
    if sinks:
        args += (spec((hkv * case.group,), jnp.float32),)
    fn = jax.jit(lambda *a: tpu.ragged_paged_attention(
        *a[:6], sm_scale=d**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap,
        block_sizes=block_sizes, sinks=a[6] if sinks else None))
    return fn.lower(*args).compile()


def interpret_test_block_sizes(case: Case) -> tpu.BlockSizes | None:
    """The block sizes test_ragged_paged_attention runs the case with."""
    return tpu.BlockSizes(block_q=max(1, 8 // case.group), pages_per_block=1) \
        if case.small_blocks else None


@pytest.mark.parametrize("name", list(CASES))
def test_interpret_mode_cases_compile_for_v5e(name: str):
    case = CASES[name]
    (q, _, page_indices, _, _), cache, _ = make_batch(case, seed=0)
    compiled = compile_for_tpu("v5e:1x1", case, q.shape[0], page_indices.shape[0],
                               page_indices.shape[1], cache.shape[0],
                               interpret_test_block_sizes(case))
    assert (compiled.out_info.shape, compiled.out_info.dtype) == (q.shape, q.dtype)


# The engine's default block sizes (default_block_sizes) at serving-sized buckets:
# decode-shaped (16-row query tiles) and prefill-shaped (256-row tiles), the KV
# heads one chip holds for Llama-3-8B at tp 1 (8) and Gemma-style head_dim 256.
ENGINE_SHAPES = {
    "decode_8B_bf16": (Case(((1, 1),), group=4, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16),
                       256, 256),
    "prefill_8B_bf16": (Case(((1, 1),), group=4, num_kv_heads=8, head_dim=128,
                             dtype=jnp.bfloat16), 2048, 256),
    "prefill_d256_window_cap_bf16": (
        Case(((1, 1),), group=2, num_kv_heads=8, head_dim=256, dtype=jnp.bfloat16,
             sliding_window=4096, soft_cap=50.0), 2048, 256),
    "prefill_d64_page128_f32": (
        Case(((1, 1),), group=8, num_kv_heads=4, head_dim=64, page_size=128), 2048, 64),
    "decode_gqa1_f32": (Case(((1, 1),), group=1, num_kv_heads=16, head_dim=128), 128, 128),
}


@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("name", list(ENGINE_SHAPES))
def test_engine_default_block_sizes_compile(topology: str, name: str):
    case, num_tokens, num_reqs = ENGINE_SHAPES[name]
    width = 2048 // case.page_size  # max_model_len 2048
    compiled = compile_for_tpu(topology, case, num_tokens, num_reqs, width,
                               num_pages=4096 * 16 // case.page_size, block_sizes=None)
    assert compiled.out_info.shape == (num_tokens, case.num_kv_heads * case.group,
                                       case.head_dim)


@pytest.mark.parametrize("name", ["gqa1", "gqa8", "d128_page32", "d256_page128", "bf16_gqa1",
                                  "bf16_gqa8_d256", "bf16_window_cap"])
def test_head_dim_and_dtype_corners_compile_for_v6e(name: str):
    """The interpret-mode cases that change tile shapes (head_dim 64/128/256, bf16 and
    float32, GQA 1 and 8) on v6e, whose MXU is 256 wide where v5e's is 128."""
    case = CASES[name]
    (q, _, page_indices, _, _), cache, _ = make_batch(case, seed=0)
    compiled = compile_for_tpu("v6e:1x1", case, q.shape[0], page_indices.shape[0],
                               page_indices.shape[1], cache.shape[0],
                               interpret_test_block_sizes(case))
    assert (compiled.out_info.shape, compiled.out_info.dtype) == (q.shape, q.dtype)


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_interpret_mode_sink_cases_compile_for_v5e(name: str):
    case = SINK_CASES[name]
    (q, _, page_indices, _, _), cache, _ = make_batch(case, seed=0)
    compiled = compile_for_tpu("v5e:1x1", case, q.shape[0], page_indices.shape[0],
                               page_indices.shape[1], cache.shape[0],
                               interpret_test_block_sizes(case), sinks=True)
    assert (compiled.out_info.shape, compiled.out_info.dtype) == (q.shape, q.dtype)


# GPT-OSS's attention on one chip: 64 query heads over 8 kv heads, head_dim 64, its
# window, sinks; the engine's default block sizes, decode- and prefill-shaped.
GPT_OSS = Case(((1, 1),), group=8, num_kv_heads=8, head_dim=64, dtype=jnp.bfloat16,
               sliding_window=128)


@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("num_tokens", [256, 2048])
def test_sinks_at_engine_block_sizes_compile(topology: str, num_tokens: int):
    compiled = compile_for_tpu(topology, GPT_OSS, num_tokens, 256, 2048 // GPT_OSS.page_size,
                               num_pages=4096, block_sizes=None, sinks=True)
    assert compiled.out_info.shape == (num_tokens, 64, 64)


@pytest.mark.parametrize("head_dim,dtype", [(32, jnp.float32), (64, jnp.bfloat16)])
def test_kv_write_and_kernel_on_the_lane_padded_cache_hold_no_copy_of_it(head_dim, dtype):
    """Two layers' KV write then attention on the donated engine cache
    (`padded_kv_cache_shape`), compiled for v5e: temporaries stay under 10% of the
    cache's bytes, where a copy or relayout of the cache would be at least 25% of
    them (an unpadded copy is a quarter of the 128-lane cache at head_dim 32)."""
    device = topology_devices("v5e:1x1")[0]
    replicated = NamedSharding(Mesh([device], ("x",)), P())
    hkv, group, page_size, num_pages, tokens, reqs, width = 2, 2, 16, 8192, 32, 8, 16

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=replicated)

    def step(cache, q, k, v, slots, kv_lens, page_indices, cu, num_seqs):
        for layer in range(2):
            offset = layer * (num_pages // 2)
            cache = tpu.write_kv(cache, k, v, slots, page_offset=offset)
            q = tpu.ragged_paged_attention(q, cache, kv_lens, page_indices, cu, num_seqs,
                                           sm_scale=head_dim**-0.5, page_offset=offset)
        return cache, q

    shape = tpu.padded_kv_cache_shape(num_pages, page_size, hkv, head_dim)
    args = (spec(shape, dtype), spec((tokens, hkv * group, head_dim), dtype),
            spec((tokens, hkv, head_dim), dtype), spec((tokens, hkv, head_dim), dtype),
            spec((tokens,), jnp.int32), spec((reqs,), jnp.int32),
            spec((reqs, width), jnp.int32), spec((reqs + 1,), jnp.int32),
            spec((1,), jnp.int32))
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    cache_bytes = num_pages * 2 * hkv * page_size * 128 * jnp.dtype(dtype).itemsize
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= cache_bytes  # updated in place
    assert mem.temp_size_in_bytes < cache_bytes // 10, mem.temp_size_in_bytes
