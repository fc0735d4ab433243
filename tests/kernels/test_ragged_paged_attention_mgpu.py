"""The Mosaic GPU (Hopper) ragged paged attention body agrees with the jnp reference.

Where it runs: on the CPU the kernel runs in Mosaic GPU interpret mode (which
simulates shared memory, TMA copies and barriers, with one CPU thread per
warpgroup); there the two wgmma matmuls are replaced by plain dots and the
register layouts are not modelled, but the work split, page-table walk, TMA
slicing, barrier protocol (producer / two consumers, stage reuse), causal
masks, online softmax and the output stores (full tiles and the power-of-two
ladder for short items) are the kernel's own. On a Hopper GPU the same tests
run the compiled kernel. Anywhere else they skip.

Interpret mode compiles one CPU program per kernel shape (seconds each), so the
batches of a group share their shapes (same token count, request slots, block
table width and page count) and only their metadata differs.

Error bounds against the reference on the same inputs upcast to float32
(bfloat16 data; P is rounded to bf16 before the PV product, as on the tensor
cores): max |err| <= 6e-2 and relative L2 error <= 1e-2. Padding rows must be
exact zeros. float32 inputs are not on the fast path (they go to `gpu.py`,
tested in test_ragged_paged_attention.py); `test_fallback_cases` checks which
calls take the fast path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mosaic_gpu_util import kernel_mode
from pallas_kernels.ragged_paged_attention import gpu_mgpu, xla

MAX_ABS, REL_L2 = 6e-2, 1e-2


MODE = kernel_mode()
pytestmark = pytest.mark.skipif(
    MODE is None or gpu_mgpu.plgpu is None,
    reason="needs the CPU (Mosaic GPU interpret mode) or a Hopper GPU")


@pytest.fixture(scope="module", autouse=True)
def _cache_interpreter_threads():
    """Interpret mode re-lowers and re-compiles the per-warpgroup program for every
    grid point (~10 s per CTA for this kernel); keying the compiled program on the
    (identical) jaxpr and argument shapes makes a CTA take a fraction of a second.
    Test-only patch of a private helper; skipped if the helper is not there."""
    if MODE != "interpret":
        yield
        return
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover
        yield
        return
    original = getattr(thread_map, "_run_jaxpr", None)
    if original is None:  # pragma: no cover
        yield
        return
    cache = {}

    def run_cached(jaxpr, consts, *args):
        key = (id(jaxpr), tuple((np.shape(a), str(np.asarray(a).dtype)) for a in (*consts, *args)))
        hit = cache.get(key)
        if hit is None:
            def run(consts, *args):
                jax.core.eval_jaxpr(jaxpr, consts, *args)

            hit = cache[key] = (jax.jit(run).lower(consts, *args).compile(), jaxpr)
        hit[0](consts, *args)

    thread_map._run_jaxpr = run_cached
    try:
        yield
    finally:
        thread_map._run_jaxpr = original


# Shape groups: (group, num_kv_heads, head_dim, page_size, block_kv, num_stages,
# schedule_barrier, persistent, num_tokens, request slots, block-table width,
# num_pages). Persistent: two CTAs walk all items (the K/V ring carries over
# from one item to the next).
SHAPES = {
    "g4": (4, 1, 64, 16, 64, 2, True, True, 128, 6, 16, 64),
    "g1": (1, 1, 64, 32, 64, 3, False, False, 96, 3, 8, 24),
    "g8": (8, 1, 128, 32, 128, 2, True, False, 80, 3, 8, 24),
}

# (shape group, [(q_len, kv_len) per real request]); tokens past the last real one
# are padding, request slots past the real ones are never read.
BATCHES = {
    # Prefill only: one request of several items, one of a partial item; no padding.
    "prefill_only": ("g4", [(100, 100), (28, 28)]),
    # Requests starting off the 8-row grid (windows shared by two requests).
    "unaligned_starts": ("g4", [(3, 3), (61, 61), (13, 77), (50, 50)]),
    # Prefill with a cached prefix (chunked prefill), padding tokens after.
    "prefill_prefix_padding": ("g4", [(45, 170), (30, 30), (20, 250)]),
    # Mixed: decodes between prefill chunks, short and long contexts.
    "mixed": ("g4", [(1, 150), (37, 90), (1, 7), (64, 64), (3, 200), (1, 1)]),
    # Every request ends on a page and a block_kv boundary; items end exactly at BQ.
    "page_boundary": ("g4", [(32, 64), (16, 16), (48, 192), (32, 32)]),
    # GQA 1: 128-token items, the two consumers hold different tokens.
    "gqa1": ("g1", [(70, 100), (1, 40), (20, 20)]),
    # GQA 8, head_dim 128: 16-token items, four query heads per consumer.
    "gqa8": ("g8", [(33, 120), (1, 60), (40, 40)]),
}


def make_batch(shape: str, seqs, seed: int):
    group, hkv, d, ps, _, _, _, _, num_tokens, slots, width, num_pages = SHAPES[shape]
    rng = np.random.default_rng(seed)
    need = [-(-kv // ps) for _, kv in seqs]
    assert len(seqs) <= slots and max(need) <= width and sum(need) < num_pages
    assert sum(q for q, _ in seqs) <= num_tokens
    perm = rng.permutation(np.arange(1, num_pages))  # page 0: scratch
    page_indices = rng.integers(0, num_pages, (slots, width)).astype(np.int32)  # stale
    k = 0
    for r, n in enumerate(need):
        page_indices[r, :n] = perm[k:k + n]
        k += n
    cu = np.zeros(slots + 1, np.int32)
    cu[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
    cu[len(seqs) + 1:] = cu[len(seqs)]
    kv_lens = np.zeros(slots, np.int32)
    kv_lens[:len(seqs)] = [kv for _, kv in seqs]
    q = rng.standard_normal((num_tokens, hkv * group, d), np.float32)
    cache = rng.standard_normal((num_pages, ps, 2 * hkv, d), np.float32)  # reference layout
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16), jnp.asarray(kv_lens),
            jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray([len(seqs)], jnp.int32))
    return args, int(cu[len(seqs)])


@functools.cache
def kernel_fn(shape: str, page_offset: int = 0):
    _, _, d, _, bkv, stages, sched, persistent, *_ = SHAPES[shape]
    bs = gpu_mgpu.BlockSizes(block_kv=bkv, num_stages=stages, schedule_barrier=sched,
                             persistent=persistent)

    @jax.jit
    def fn(q, cache, kv_lens, page_indices, cu, num_seqs):
        assert gpu_mgpu.supported(q, cache, page_indices, interpret=MODE == "interpret",
                                  block_sizes=bs)
        return gpu_mgpu.ragged_paged_attention(
            q, cache, kv_lens, page_indices, cu, num_seqs, sm_scale=d**-0.5, block_sizes=bs,
            interpret=MODE == "interpret", page_offset=page_offset)

    return fn


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.slow
def test_kernel_matches_reference(name: str):
    shape, seqs = BATCHES[name]
    d = SHAPES[shape][2]
    (q, cache, kv_lens, page_indices, cu, num_seqs), num_real = make_batch(
        shape, seqs, seed=list(BATCHES).index(name))
    with jax.default_matmul_precision("highest"):
        ref = xla.ragged_paged_attention(
            q.astype(jnp.float32), cache.astype(jnp.float32), kv_lens, page_indices, cu,
            num_seqs, sm_scale=d**-0.5)
    out = kernel_fn(shape)(q, cache.transpose(0, 2, 1, 3), kv_lens, page_indices, cu, num_seqs)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[num_real:], 0.0)
    err = out[:num_real] - ref[:num_real]
    assert np.abs(err).max() <= MAX_ABS, np.abs(err).max()
    rel = np.linalg.norm(err) / np.linalg.norm(ref[:num_real])
    assert rel <= REL_L2, rel


def test_fallback_cases():
    """What takes the Mosaic GPU path (shape checks only; nothing runs)."""
    interpret = MODE == "interpret"

    def ok(t=256, hq=8, hkv=2, d=128, ps=16, dtype=jnp.bfloat16, reqs=4, **kw):
        q = jax.ShapeDtypeStruct((t, hq, d), dtype)
        cache = jax.ShapeDtypeStruct((64, 2 * hkv, ps, d), dtype)
        pages = jax.ShapeDtypeStruct((reqs, 32), jnp.int32)
        return gpu_mgpu.supported(q, cache, pages, interpret=interpret, **kw)

    assert ok()
    assert ok(d=64, ps=128)
    assert not ok(dtype=jnp.float32)
    assert not ok(d=256)
    assert not ok(sliding_window=64)
    assert not ok(soft_cap=30.0)
    assert not ok(sinks=jax.ShapeDtypeStruct((8,), jnp.float32))  # gpu.py counts them
    assert not ok(hq=6, hkv=2)  # G = 3
    assert not ok(ps=256)
    assert not ok(t=64, reqs=64)  # decode-shaped
    assert not ok(t=260)  # not a whole number of 8-row tiles


@pytest.mark.parametrize("skip_decode", [False, True])
def test_work_items_cover_every_row_once(skip_decode: bool):
    """Windows start on the 8-row grid, lie in one segment, and own every row once;
    with `skip_decode` the one-token requests' rows are owned by no item. The used
    items come first and their count is returned (the kernel stops there)."""
    cu = np.asarray([0, 1, 9, 9, 30, 31, 47], np.int32)  # one empty request
    num_tokens, block_q, n = 64, 16, 5
    req, w0, lo, hi, count = (np.asarray(x) for x in gpu_mgpu.work_items(
        jnp.asarray(cu), jnp.asarray([n], jnp.int32), num_tokens, block_q,
        skip_decode=skip_decode))
    assert count.shape == (1,) and 0 < count[0] < len(req)
    assert (req[:count[0]] != -2).all() and (req[count[0]:] == -2).all()
    owner = np.full(num_tokens, -3)
    for r, w, a, b in zip(req, w0, lo, hi, strict=True):
        if r == -2:
            continue
        assert w % 8 == 0 and w <= a < b <= w + block_q
        seg_lo, seg_hi = (cu[r], cu[r + 1]) if r >= 0 else (cu[n], num_tokens)
        assert seg_lo <= a and b <= seg_hi
        assert (owner[a:b] == -3).all()
        owner[a:b] = r
    want = np.concatenate([np.repeat(np.arange(n), np.diff(cu[:n + 1])),
                           np.full(num_tokens - cu[n], -1)])
    if skip_decode:  # requests 0 and 3 have one token each
        want[[0, 30]] = -3
    np.testing.assert_array_equal(owner, want)


@pytest.mark.slow
def test_mosaic_backend_routes_prefill_steps_to_the_mosaic_body(monkeypatch):
    """The engine's opt-in backend: a prefill-shaped bf16 step (KV written through the
    backend, then attended) runs this body and matches the reference."""
    from jaxllm.layers.attention import AttentionBackend, AttentionMetadata
    from jaxllm.layers.attention_pallas import PallasGPUMosaicBackend

    calls = []
    real = gpu_mgpu._mgpu_call
    monkeypatch.setattr(gpu_mgpu, "_mgpu_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    group, hkv, d, ps, *_ = SHAPES["g4"]
    (q, cache, kv_lens, page_indices, cu, num_seqs), num_real = make_batch(
        "g4", [(40, 40), (24, 90)], seed=7)
    rng = np.random.default_rng(8)
    # Slots of the new tokens (the last q_len positions of each request).
    slots = np.zeros(q.shape[0], np.int32)
    cu_np, kv_np, pi_np = np.asarray(cu), np.asarray(kv_lens), np.asarray(page_indices)
    for r in range(int(num_seqs[0])):
        q_len = cu_np[r + 1] - cu_np[r]
        pos = np.arange(kv_np[r] - q_len, kv_np[r])
        slots[cu_np[r]:cu_np[r + 1]] = pi_np[r, pos // ps] * ps + pos % ps
    k = jnp.asarray(rng.standard_normal((q.shape[0], hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((q.shape[0], hkv, d)), jnp.bfloat16)
    md = AttentionMetadata(jnp.asarray(slots), kv_lens, page_indices, cu, num_seqs)
    outs = []
    # A backend of its own (not get_attention_backend's shared one): its jitted attend
    # must trace here, where _mgpu_call is the counting one.
    mosaic = PallasGPUMosaicBackend(interpret=MODE == "interpret")
    for backend in (AttentionBackend(), mosaic):
        layout = cache if type(backend) is AttentionBackend else cache.transpose(0, 2, 1, 3)
        kv = backend.write_kv(layout.astype(jnp.bfloat16), k, v, md)
        with jax.default_matmul_precision("highest"):
            outs.append(np.asarray(backend.attend(q, kv, md, sm_scale=d**-0.5)
                                   .astype(jnp.float32)))
    assert calls, "the prefill-shaped step did not take the Mosaic GPU body"
    ref, out = outs
    np.testing.assert_array_equal(out[num_real:], 0.0)
    err = out[:num_real] - ref[:num_real]
    assert np.abs(err).max() <= MAX_ABS
    assert np.linalg.norm(err) / np.linalg.norm(ref[:num_real]) <= REL_L2


@pytest.mark.slow
def test_backend_loads_the_mosaic_gpu_runtime_when_made():
    """A warm start runs the cached programs without tracing the kernel; their Mosaic GPU
    kernels link against functions of the runtime that jax's Mosaic GPU module loads
    (without it the H100 warm start failed: "Failed to lookup host symbol"). Making the
    backend must import that module, in a fresh interpreter where nothing else did."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from jaxllm.layers.attention import get_attention_backend\n"
        "mod = 'jax.experimental.mosaic.gpu'\n"
        "assert mod not in sys.modules, 'imported before the backend was made'\n"
        "get_attention_backend('pallas_gpu_mosaic', interpret=True)\n"
        "assert mod in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_page_offset_reads_the_pages_of_a_later_layer():
    """The engine's cache holds every layer's pages; a layer's block-table entries count
    from its `page_offset`, which the kernel takes as an input (one kernel for every
    layer). The same batch placed `off` pages further on, behind pages of garbage,
    must give the reference's result for the batch where it was."""
    shape, seqs = BATCHES["mixed"]
    d = SHAPES[shape][2]
    (q, cache, kv_lens, page_indices, cu, num_seqs), num_real = make_batch(shape, seqs, seed=11)
    off = 5
    garbage = jnp.full((off, *cache.shape[1:]), 1e4, cache.dtype)
    with jax.default_matmul_precision("highest"):
        ref = xla.ragged_paged_attention(
            q.astype(jnp.float32), cache.astype(jnp.float32), kv_lens, page_indices, cu,
            num_seqs, sm_scale=d**-0.5)
    shifted = jnp.concatenate([garbage, cache]).transpose(0, 2, 1, 3)
    out = kernel_fn(shape, page_offset=off)(q, shifted, kv_lens, page_indices, cu, num_seqs)
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_array_equal(out[num_real:], 0.0)
    err = out[:num_real] - np.asarray(ref)[:num_real]
    assert np.abs(err).max() <= MAX_ABS
    assert np.linalg.norm(err) <= REL_L2 * np.linalg.norm(np.asarray(ref)[:num_real])
