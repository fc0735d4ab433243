"""The Pallas TPU and GPU ragged paged attention bodies agree with the jnp reference.

Both kernels run in Pallas interpret mode on the CPU (the TPU one in TPU
interpret mode, which simulates VMEM, DMAs and semaphores) on random ragged
batches. Error bounds, against the reference on the same (upcast) inputs:
float32: max |err| <= 1e-4 and relative L2 error <= 1e-5 (the kernels run
float32 dots at full precision); bfloat16: max |err| <= 6e-2 and relative L2
<= 1e-2 (P is rounded to bf16 before the PV product, as on the real units).
Padding rows must come back as exact zeros. Attention sinks (GPT-OSS) are held to
the same bounds, on cases whose sinks move the reference well past them.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import gpu, paged_layout, tpu, xla

TOL = {jnp.float32: (1e-4, 1e-5), jnp.bfloat16: (6e-2, 1e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per real request
    group: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    dtype: type = jnp.float32
    sliding_window: int | None = None
    soft_cap: float | None = None
    pad_tokens: int = 3
    pad_reqs: int = 2
    small_blocks: bool = False  # many KV blocks per request: exercises the pipelines


CASES = {
    "decode_only": Case(((1, 37), (1, 5), (1, 64), (1, 20), (1, 1), (1, 50))),
    "prefill_only": Case(((17, 17), (32, 32), (5, 5)), pad_reqs=0),
    "mixed": Case(((1, 40), (9, 30), (1, 7), (24, 24), (3, 70)), small_blocks=True),
    "page_boundary": Case(((16, 16), (1, 32), (4, 48), (16, 64)), pad_tokens=0),
    "single_token": Case(((1, 1),), pad_tokens=0, pad_reqs=0),
    # Batch-1 decode as the engine runs it: one slot, the token bucket padded to 8.
    "batch1_decode": Case(((1, 150),), group=4, head_dim=128, pad_tokens=7, pad_reqs=0),
    "gqa1": Case(((1, 33), (6, 20), (12, 12)), group=1),
    "gqa4": Case(((1, 33), (6, 20), (12, 12)), group=4, small_blocks=True),
    "gqa8": Case(((1, 33), (6, 20), (12, 12)), group=8, num_kv_heads=1),
    "sliding_window": Case(((1, 60), (20, 45), (30, 30)), sliding_window=13,
                           small_blocks=True),
    "soft_cap": Case(((1, 60), (20, 45), (7, 7)), soft_cap=2.0),
    "bf16_window_cap": Case(((1, 50), (10, 40), (16, 16)), dtype=jnp.bfloat16,
                            sliding_window=24, soft_cap=5.0),
    "d128_page32": Case(((1, 70), (8, 40)), head_dim=128, page_size=32, dtype=jnp.bfloat16),
    "d256_page128": Case(((1, 130), (5, 5)), head_dim=256, page_size=128, group=4),
    # bf16 across the GQA groups (q rows per kv head change the bf16 tile shapes),
    # with page size 64 and head_dim 256 folded in.
    "bf16_gqa1": Case(((1, 33), (6, 20)), group=1, dtype=jnp.bfloat16),
    "bf16_gqa4_page64": Case(((1, 100), (9, 70)), group=4, page_size=64, dtype=jnp.bfloat16),
    "bf16_gqa8_d256": Case(((1, 40), (6, 6)), group=8, num_kv_heads=1, head_dim=256,
                           dtype=jnp.bfloat16),
    "window_gqa8": Case(((1, 60), (20, 45)), group=8, num_kv_heads=1, sliding_window=13,
                        small_blocks=True),
}


# Attention sinks: a prompt chunk beside decodes (prefill-shaped on the GPU: the decodes
# in their own call, one KV split each), decodes only over long contexts (the GPU
# default splits the KV walk; the short request leaves most splits without a key), and
# bf16 GQA 4 under a sliding window with small blocks (three splits on the GPU).
SINK_CASES = {
    "sinks_prefill_decode": Case(((1, 40), (20, 20), (1, 90), (9, 30), (5, 70))),
    "sinks_decode_split": Case(((1, 300), (1, 129), (1, 1), (1, 200)), group=4),
    "sinks_bf16_gqa4_window": Case(((1, 60), (20, 45), (30, 30)), group=4,
                                   dtype=jnp.bfloat16, sliding_window=13, small_blocks=True),
}


def make_sinks(num_q_heads: int, seed: int) -> jax.Array:
    """Per-head sink logits from well below to well above the rows' typical logits."""
    return jnp.asarray(np.random.default_rng(seed).uniform(-2.0, 4.0, num_q_heads),
                       jnp.float32)


def make_batch(case: Case, seed: int):
    """Random ragged batch; returns (inputs, KV cache in the reference layout)."""
    rng = np.random.default_rng(seed)
    ps, hkv, d = case.page_size, case.num_kv_heads, case.head_dim
    num_req = len(case.seqs) + case.pad_reqs
    need = [-(-kv // ps) for _, kv in case.seqs]
    width = max(need) + 1
    num_pages = sum(need) + 3  # page 0 is the scratch page
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((num_req, width), np.int32)  # padded requests: page 0
    k = 0
    for r, n in enumerate(need):
        page_indices[r, :n] = perm[k:k + n]
        page_indices[r, n:] = rng.integers(0, num_pages, width - n)  # stale entries
        k += n
    cu = np.zeros(num_req + 1, np.int32)
    cu[1:len(case.seqs) + 1] = np.cumsum([q for q, _ in case.seqs])
    cu[len(case.seqs) + 1:] = cu[len(case.seqs)]
    kv_lens = np.zeros(num_req, np.int32)
    kv_lens[:len(case.seqs)] = [kv for _, kv in case.seqs]
    num_tokens = int(cu[-1]) + case.pad_tokens
    q = rng.standard_normal((num_tokens, hkv * case.group, d), np.float32)
    cache = rng.standard_normal((num_pages, ps, 2 * hkv, d), np.float32)
    args = (jnp.asarray(q, case.dtype), jnp.asarray(kv_lens), jnp.asarray(page_indices),
            jnp.asarray(cu), jnp.asarray([len(case.seqs)], jnp.int32))
    return args, jnp.asarray(cache, case.dtype), int(cu[len(case.seqs)])


def run_kernel(backend: str, case: Case, q, cache_ref_layout, kv_lens, page_indices, cu,
               num_seqs, **kw):
    cache = cache_ref_layout.transpose(0, 2, 1, 3)  # -> [P, 2H, ps, D]
    if backend == "tpu":
        bs = tpu.BlockSizes(block_q=max(1, 8 // case.group), pages_per_block=1) \
            if case.small_blocks else None
        fn = tpu.ragged_paged_attention
    else:
        bs = gpu.BlockSizes(block_q=max(1, 16 // case.group), block_kv=16, num_kv_splits=3) \
            if case.small_blocks else None
        fn = gpu.ragged_paged_attention
    return fn(q, cache, kv_lens, page_indices, cu, num_seqs, block_sizes=bs, interpret=True,
              **kw)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_kernel_matches_reference(backend: str, name: str):
    case = CASES[name]
    (q, kv_lens, page_indices, cu, num_seqs), cache, num_real = make_batch(
        case, seed=list(CASES).index(name))
    kw = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window,
              soft_cap=case.soft_cap)
    with jax.default_matmul_precision("highest"):
        ref = xla.ragged_paged_attention(
            q.astype(jnp.float32), cache.astype(jnp.float32), kv_lens, page_indices, cu,
            num_seqs, **kw)
    out = run_kernel(backend, case, q, cache, kv_lens, page_indices, cu, num_seqs, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[num_real:], 0.0)
    max_abs, rel_l2 = TOL[case.dtype]
    err = out[:num_real] - ref[:num_real]
    assert np.abs(err).max() <= max_abs, np.abs(err).max()
    assert np.linalg.norm(err) <= rel_l2 * np.linalg.norm(ref[:num_real]), (
        np.linalg.norm(err) / np.linalg.norm(ref[:num_real]))


def gpu_default_block_sizes(case: Case, q: jax.Array, page_indices: jax.Array
                            ) -> gpu.BlockSizes:
    """What `gpu.default_block_sizes` gives this batch's shapes."""
    return gpu.default_block_sizes(q.shape[0], page_indices.shape[0], case.group,
                                   case.head_dim, case.page_size, page_indices.shape[1],
                                   case.num_kv_heads, jnp.dtype(case.dtype).itemsize)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(SINK_CASES))
@pytest.mark.slow
def test_kernel_with_sinks_matches_reference(backend: str, name: str):
    case = SINK_CASES[name]
    (q, kv_lens, page_indices, cu, num_seqs), cache, num_real = make_batch(
        case, seed=100 + list(SINK_CASES).index(name))
    if backend == "gpu" and not case.small_blocks:  # the paths the names promise
        bs = gpu_default_block_sizes(case, q, page_indices)
        if name == "sinks_decode_split":
            assert bs.num_kv_splits >= 4  # the split walk and the combine
        else:
            assert bs.decode is not None and bs.num_kv_splits == 1  # two one-split calls
    sinks = make_sinks(q.shape[1], seed=list(SINK_CASES).index(name))
    kw = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window,
              soft_cap=case.soft_cap)
    ref_args = (q.astype(jnp.float32), cache.astype(jnp.float32), kv_lens, page_indices, cu,
                num_seqs)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(xla.ragged_paged_attention(*ref_args, sinks=sinks, **kw))
        no_sinks = np.asarray(xla.ragged_paged_attention(*ref_args, **kw))
    max_abs, rel_l2 = TOL[case.dtype]
    # The sinks move the answer by far more than the bounds: ignoring them (or counting
    # one twice) fails.
    assert np.abs(ref - no_sinks).max() > 10 * max_abs
    out = run_kernel(backend, case, q, cache, kv_lens, page_indices, cu, num_seqs,
                     sinks=sinks, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[num_real:], 0.0)
    err = out[:num_real] - ref[:num_real]
    assert np.abs(err).max() <= max_abs, np.abs(err).max()
    assert np.linalg.norm(err) <= rel_l2 * np.linalg.norm(ref[:num_real]), (
        np.linalg.norm(err) / np.linalg.norm(ref[:num_real]))


def test_gpu_work_items_cover_every_token_once():
    cu = jnp.asarray([0, 1, 9, 9, 30, 31, 31], jnp.int32)  # one empty request
    num_tokens, block_q = 36, 4
    req, tok = gpu.work_items(cu, jnp.asarray([5], jnp.int32), num_tokens, block_q)
    req, tok = np.asarray(req), np.asarray(tok)
    assert req.shape[0] >= 1 + np.sum(np.asarray([1, 2, 0, 6, 1])) + 2
    seen = np.zeros(num_tokens, int)
    ends = np.asarray(cu)
    for r, t in zip(req, tok, strict=True):
        if r == -2:
            continue
        stop = num_tokens if r == -1 else ends[r + 1]
        seen[t:min(t + block_q, stop)] += 1
    np.testing.assert_array_equal(seen, 1)


def test_gpu_decode_split_items_cover_every_token_once():
    """Prefill tiles with a separate decode call: the one-token requests' items and
    the main call's items (padding included) cover every token exactly once."""
    cu = jnp.asarray([0, 1, 9, 10, 10, 30, 31, 32, 32], jnp.int32)  # decodes 0, 2, 5, 6
    num_seqs, num_tokens, block_q = jnp.asarray([7], jnp.int32), 37, 4
    seen = np.zeros(num_tokens, int)
    ends = np.asarray(cu)
    req, tok = (np.asarray(x) for x in gpu.work_items(cu, num_seqs, num_tokens, block_q,
                                                      skip_decode=True))
    for r, t in zip(req, tok, strict=True):
        if r >= 0:
            assert ends[r + 1] - ends[r] > 1  # no decode request here
        if r != -2:
            seen[t:min(t + block_q, num_tokens if r == -1 else ends[r + 1])] += 1
    dreq, dtok = (np.asarray(x) for x in gpu.decode_items(cu, num_seqs))
    assert dreq.shape[0] == cu.shape[0] - 1  # one grid slot per request
    np.testing.assert_array_equal(np.sort(dreq[dreq >= 0]), [0, 2, 5, 6])
    for r, t in zip(dreq, dtok, strict=True):
        if r >= 0:
            assert t == ends[r]
            seen[t] += 1
    np.testing.assert_array_equal(seen, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_gpu_decode_split_matches_single_call(dtype):
    """Decodes beside prompt chunks (prefill tiles): the two-call path and the
    single call both match the reference; padding rows stay zero."""
    case = Case(((1, 40), (1, 7), (20, 20), (1, 90), (9, 30), (1, 1), (5, 70)), group=4,
                head_dim=128, dtype=dtype, pad_tokens=5, pad_reqs=3)
    (q, kv_lens, page_indices, cu, num_seqs), cache, num_real = make_batch(case, seed=7)
    kw = dict(sm_scale=case.head_dim**-0.5)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(xla.ragged_paged_attention(
            q.astype(jnp.float32), cache.astype(jnp.float32), kv_lens, page_indices, cu,
            num_seqs, **kw))
    num_tokens, num_req = q.shape[0], page_indices.shape[0]
    split = gpu.default_block_sizes(num_tokens, num_req, case.group, case.head_dim,
                                    case.page_size, page_indices.shape[1], case.num_kv_heads,
                                    jnp.dtype(dtype).itemsize)
    assert split.decode is not None  # prefill-shaped: the default splits the decodes off
    max_abs, rel_l2 = TOL[dtype]
    outs = []
    for bs in (split, dataclasses.replace(split, decode=None)):
        out = gpu.ragged_paged_attention(q, cache.transpose(0, 2, 1, 3), kv_lens, page_indices,
                                         cu, num_seqs, block_sizes=bs, interpret=True, **kw)
        out = np.asarray(out.astype(jnp.float32))
        np.testing.assert_array_equal(out[num_real:], 0.0)
        err = out[:num_real] - ref[:num_real]
        assert np.abs(err).max() <= max_abs
        assert np.linalg.norm(err) <= rel_l2 * np.linalg.norm(ref[:num_real])
        outs.append(out)
    np.testing.assert_allclose(outs[0], outs[1], atol=max_abs)


def test_tpu_block_request_ranges():
    cu = jnp.asarray([0, 1, 9, 9, 30, 31, 31], jnp.int32)
    lo, hi = tpu.block_request_ranges(cu, jnp.asarray([5], jnp.int32), 9, 4)
    # Block 2 covers tokens 8..11: request 1 (ends at 9), empty request 2, request 3.
    assert (int(lo[2]), int(hi[2])) == (1, 4)
    assert (int(lo[7]), int(hi[7])) == (3, 5)  # tokens 28..30
    assert int(lo[8]) == int(hi[8]) == 0  # past the last real token


@pytest.mark.parametrize("module", [gpu, tpu])
def test_write_kv_matches_reference_layout(module):
    rng = np.random.default_rng(0)
    num_pages, ps, hkv, d, tokens = 5, 4, 2, 8, 7
    cache = jnp.asarray(rng.standard_normal((num_pages, ps, 2 * hkv, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((tokens, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tokens, hkv, d)), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(ps, num_pages * ps))[:tokens], jnp.int32)
    want = xla.write_kv(cache, k, v, slots).transpose(0, 2, 1, 3)
    got = module.write_kv(cache.transpose(0, 2, 1, 3), k, v, slots)
    assert module.kv_cache_shape(num_pages, ps, hkv, d) == got.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("head_dim", [32, 64])
def test_tpu_kernel_on_a_lane_padded_cache_matches_reference(head_dim: int):
    """The engine's TPU cache (`padded_kv_cache_shape`) pads head_dim to 128 lanes;
    K/V written by `tpu.write_kv` into it and read back by the kernel give the
    reference's output at the true head_dim."""
    case = Case(((1, 37), (9, 30), (1, 5)), group=2, head_dim=head_dim)
    (q, kv_lens, page_indices, cu, num_seqs), cache, num_real = make_batch(case, seed=7)
    num_pages, ps, two_h, d = cache.shape
    shape = tpu.padded_kv_cache_shape(num_pages, ps, two_h // 2, d)
    assert shape == (num_pages, two_h, ps, 128)
    # Every slot's K/V written through tpu.write_kv (slot = page * ps + offset).
    slots = jnp.arange(num_pages * ps, dtype=jnp.int32)
    kv = cache.reshape(num_pages * ps, two_h // 2, 2, d)
    padded = tpu.write_kv(jnp.full(shape, jnp.nan, jnp.float32), kv[:, :, 0], kv[:, :, 1],
                          slots)
    np.testing.assert_array_equal(np.asarray(padded[..., d:]), 0.0)
    np.testing.assert_array_equal(np.asarray(padded[..., :d]),
                                  np.asarray(cache.transpose(0, 2, 1, 3)))
    kw = dict(sm_scale=d**-0.5)
    with jax.default_matmul_precision("highest"):
        ref = xla.ragged_paged_attention(q, cache, kv_lens, page_indices, cu, num_seqs,
                                               **kw)
    out = tpu.ragged_paged_attention(q, padded, kv_lens, page_indices, cu, num_seqs,
                                     interpret=True, **kw)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out[:num_real]), np.asarray(ref[:num_real]),
                               atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[num_real:]), 0.0)


@pytest.mark.parametrize("head_dim,group,with_sinks", [(24, 3, False), (96, 5, True),
                                                      (64, 7, False)])
def test_gpu_kernel_on_a_padded_cache_with_any_group_matches_reference(head_dim, group,
                                                                        with_sinks):
    """The engine's GPU cache (`padded_kv_cache_shape`) rounds head_dim up to a power of
    two (Phi-3's 96 to 128), and the wrapper pads each kv head's query heads to one
    (Qwen2.5-7B's 7, -14B's 5): K/V written by `write_kv_padded` and read back give the
    reference's output at the true head_dim and group, prefill rows beside decodes."""
    case = Case(((1, 37), (9, 30), (1, 5), (20, 20)), group=group, head_dim=head_dim)
    (q, kv_lens, page_indices, cu, num_seqs), cache, num_real = make_batch(case, seed=group)
    num_pages, ps, two_h, d = cache.shape
    shape = gpu.padded_kv_cache_shape(num_pages, ps, two_h // 2, d)
    assert shape == (num_pages, two_h, ps, gpu.pow2_at_least(d))
    slots = jnp.arange(num_pages * ps, dtype=jnp.int32)
    kv = cache.reshape(num_pages * ps, two_h // 2, 2, d)
    padded = paged_layout.write_kv_padded(jnp.full(shape, jnp.nan, jnp.float32),
                                          kv[:, :, 0], kv[:, :, 1], slots)
    np.testing.assert_array_equal(np.asarray(padded[..., d:]), 0.0)
    kw = dict(sm_scale=d**-0.5,
              sinks=make_sinks(q.shape[1], seed=group) if with_sinks else None)
    with jax.default_matmul_precision("highest"):
        ref = xla.ragged_paged_attention(q, cache, kv_lens, page_indices, cu, num_seqs, **kw)
    out = gpu.ragged_paged_attention(q, padded, kv_lens, page_indices, cu, num_seqs,
                                     interpret=True, **kw)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out[:num_real]), np.asarray(ref[:num_real]),
                               atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[num_real:]), 0.0)


@pytest.mark.parametrize("splits,dtype,with_sinks", [(16, jnp.bfloat16, False),
                                                     (3, jnp.float32, False),
                                                     (3, jnp.float32, True)])
def test_split_kv_combine_kernel_equals_the_jnp_combine(splits, dtype, with_sinks):
    """`combine_splits` (one program a query row) merges split-KV partials as `_combine`
    and the cast did: splits that saw no key (log-sum-exp -inf) weigh nothing, a row no
    split saw comes back zero, and a split count off the powers of two is padded. With
    sinks (rows are (token, head), 2 tokens of 3 heads), each row's head's sink joins
    once: a row one split saw is that split's output scaled by 1 / (1 + e^(sink - lse))."""
    rows, head_dim = 6, 32
    rng = np.random.default_rng(splits)
    o = rng.normal(size=(splits, rows, head_dim)).astype(np.float32)
    lse = (4 * rng.normal(size=(splits, rows))).astype(np.float32)
    lse[1:, 2] = -np.inf  # one split saw keys
    lse[:, 4] = -np.inf  # none did (a padding row)
    o[:, 4] = 0.0
    sinks = jnp.asarray([-1.0, 0.5, 3.0], jnp.float32) if with_sinks else None
    got = np.asarray(gpu.combine_splits(jnp.asarray(o.reshape(splits, -1)), jnp.asarray(lse),
                                        dtype, interpret=True, sinks=sinks))
    want = np.asarray(gpu._combine(jnp.asarray(o), jnp.asarray(lse), sinks).astype(dtype))
    assert got.dtype == want.dtype and got.shape == (rows, head_dim)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                               rtol=1e-6 if dtype == jnp.float32 else 1e-2, atol=1e-6)
    # Row 2 (head 2): the one split's output, scaled by the sink's share when given.
    share = 1.0 if sinks is None else 1.0 / (1.0 + 2.0 ** (3.0 * np.log2(np.e) - lse[0, 2]))
    np.testing.assert_allclose(got[2].astype(np.float32), share * o[0, 2], rtol=1e-2,
                               atol=1e-6)
    assert not got[4].any()


@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_decode_call_with_kv_splits_lowers_to_two_triton_kernels_for_cuda(with_sinks):
    """Batch-1 decode at the Qwen3-30B-A3B attention shape (32 query heads over 4 KV heads,
    head_dim 128): the split walk and the combine, both Triton, and no exponential left
    to XLA (the jnp combine's); with sinks too (the Triton lowering takes the combine's
    sink read)."""
    t, hq, hk, d, pages, page = 8, 32, 4, 128, 64, 16
    shapes = (jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((pages, 2 * hk, page, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((t, 8), jnp.int32),
              jax.ShapeDtypeStruct((t + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    if with_sinks:
        shapes += (jax.ShapeDtypeStruct((hq,), jnp.float32),)

    def fn(*args):
        sinks = args[6] if with_sinks else None
        return gpu.ragged_paged_attention(*args[:6], sm_scale=d ** -0.5, sinks=sinks)

    assert gpu.default_block_sizes(t, t, hq // hk, d, page, 8, hk).num_kv_splits > 1
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("ragged_paged_attention_combine") >= 1
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 2
    assert "stablehlo.exponential" not in text


@pytest.mark.parametrize("num_tokens", [8, 64])
def test_the_gpu_body_with_sinks_lowers_to_two_triton_kernels_for_cuda(num_tokens):
    """The GPU body's paths with sinks pass the Triton lowering (the CPU has no GPU to
    compile for): decode-shaped, a split walk and its combine; prefill-shaped, the
    one-token requests' call and the prefill call, both one split reading the sinks.
    No exponential is left to XLA."""
    reqs, hq, hk, d, pages, page = 8, 16, 2, 64, 64, 16
    bs = gpu.default_block_sizes(num_tokens, reqs, hq // hk, d, page, 8, hk)
    assert bs.num_kv_splits > 1 if num_tokens == 8 else bs.decode is not None
    shapes = (jax.ShapeDtypeStruct((num_tokens, hq, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((pages, 2 * hk, page, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((reqs,), jnp.int32), jax.ShapeDtypeStruct((reqs, 8), jnp.int32),
              jax.ShapeDtypeStruct((reqs + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
              jax.ShapeDtypeStruct((hq,), jnp.float32))
    fn = functools.partial(gpu.ragged_paged_attention, sm_scale=d ** -0.5)
    text = jax.jit(lambda *a: fn(*a[:6], sinks=a[6])).trace(*shapes).lower(
        lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 2
    assert "stablehlo.exponential" not in text


def _pallas_operand_counts(fn, *args) -> list[int]:
    """How many operands each pallas_call in `fn`'s jaxpr takes, in program order."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [len(e.invars) for e in jaxpr.eqns if e.primitive.name == "pallas_call"]


@pytest.mark.parametrize("body,num_tokens,want", [
    ("tpu", 8, [(8, 9)]),
    ("gpu", 8, [(8, 8), (2, 3)]),  # split walk (sinks left to the combine), the combine
    ("gpu", 64, [(8, 9), (9, 10)]),  # decodes' call, then the prefill call aliased into it
])
def test_without_sinks_no_sink_operand_reaches_a_kernel(body, num_tokens, want):
    """`sinks=None` is a static branch: each pallas_call gets the operands it had before
    sinks existed, and a sink operand goes only to the one place that counts the sinks."""
    reqs, hq, hk, d, page = 8, 8, 2, 64, 16
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(num_tokens, hq, d)), jnp.float32),
            jnp.zeros((32, 2 * hk, page, d), jnp.float32),
            jnp.full((reqs,), 40, jnp.int32), jnp.ones((reqs, 4), jnp.int32),
            jnp.minimum(jnp.arange(reqs + 1, dtype=jnp.int32) * (num_tokens // reqs),
                        num_tokens), jnp.asarray([reqs], jnp.int32))
    kernel = tpu.ragged_paged_attention if body == "tpu" else gpu.ragged_paged_attention

    def fn(*a, sinks=None):
        return kernel(*a, sm_scale=d**-0.5, interpret=True, sinks=sinks)

    without = _pallas_operand_counts(fn, *args)
    with_sinks = _pallas_operand_counts(
        functools.partial(fn, sinks=jnp.zeros(hq, jnp.float32)), *args)
    assert list(zip(without, with_sinks, strict=True)) == want
