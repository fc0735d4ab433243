"""Attention backend selection, the in-place KV update, and the Pallas backends end to end.

The Pallas backends run in interpret mode; whatever their cache layout, writing a
batch's K/V and attending must give the reference backend's answer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from jaxllm.errors import ParameterError
from jaxllm.layers.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from jaxllm.layers.attention_pallas import PallasGPUBackend, PallasTPUBackend
from jaxllm.layers.attention_sharded import ShardedAttention

BLOCK, NUM_BLOCKS, HKV, GROUP, D = 8, 12, 2, 2, 32


def test_auto_picks_xla_on_cpu_and_names_override():
    auto = get_attention_backend("auto")
    assert type(auto) is AttentionBackend and auto.name == "xla"
    # The XLA body's earlier name stays accepted.
    assert type(get_attention_backend("reference")) is AttentionBackend
    tpu = get_attention_backend("pallas_tpu", interpret=True)
    gpu = get_attention_backend("pallas_gpu", interpret=True)
    assert isinstance(tpu, PallasTPUBackend) and tpu.interpret
    assert isinstance(gpu, PallasGPUBackend) and gpu.interpret
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash")
    # A compiled Pallas body asked for on the wrong platform: the field is named.
    for name in ("pallas_gpu", "pallas_gpu_mosaic", "pallas_tpu"):
        with pytest.raises(ParameterError, match="attention_backend.*devices are 'cpu'"):
            get_attention_backend(name)


@pytest.mark.parametrize("capability,want", [("9.0", "pallas_gpu_mosaic"),
                                              ("8.0", "pallas_gpu")])
def test_auto_picks_the_mosaic_body_on_hopper_only(monkeypatch, capability, want):
    """On a GPU, "auto" is the Mosaic GPU prefill body where it runs (compute capability
    9.x), the Triton body elsewhere (a stand-in device; the caches are bypassed)."""
    from pallas_kernels import mosaic_gpu_util

    class FakeGPU:
        platform = "gpu"
        compute_capability = capability

    monkeypatch.setattr(jax, "devices", lambda *a, **k: [FakeGPU()])
    mosaic_gpu_util.is_hopper.cache_clear()
    try:
        assert get_attention_backend.__wrapped__("auto").name == want
    finally:
        monkeypatch.undo()
        mosaic_gpu_util.is_hopper.cache_clear()


@pytest.mark.parametrize("backend,minor", [(PallasTPUBackend(True), 128),
                                           (PallasGPUBackend(True), D)])
def test_pallas_layout_is_head_major_pages(backend, minor):
    """The TPU cache pads head_dim (32 here) to the 128 lanes; the GPU keeps it."""
    assert backend.kv_cache_shape(NUM_BLOCKS, BLOCK, HKV, D) == (NUM_BLOCKS, 2 * HKV, BLOCK,
                                                                 minor)


def _step(seqs, seed=0):
    """Metadata, q and every context position's K/V for requests (q_len, kv_len)."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, NUM_BLOCKS))
    width = max(-(-kv // BLOCK) for _, kv in seqs)
    table = np.zeros((len(seqs) + 1, width), np.int32)  # one padded request
    slots, k = [], 0
    for r, (_, kv) in enumerate(seqs):
        n = -(-kv // BLOCK)
        table[r, :n] = pages[k:k + n]
        k += n
        slots += [table[r, p // BLOCK] * BLOCK + p % BLOCK for p in range(kv)]
    cu = np.zeros(len(seqs) + 2, np.int32)
    cu[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
    cu[-1] = cu[-2]
    kv_lens = np.asarray([kv for _, kv in seqs] + [0], np.int32)
    num_tokens = int(cu[-1]) + 2  # two padding tokens
    md = AttentionMetadata(slot_mapping=jnp.zeros(num_tokens, jnp.int32),
                           kv_lens=jnp.asarray(kv_lens), page_indices=jnp.asarray(table),
                           cu_q_lens=jnp.asarray(cu),
                           num_seqs=jnp.asarray([len(seqs)], jnp.int32))
    q = jnp.asarray(rng.standard_normal((num_tokens, HKV * GROUP, D)), jnp.float32)
    kk = jnp.asarray(rng.standard_normal((len(slots), HKV, D)), jnp.float32)
    vv = jnp.asarray(rng.standard_normal((len(slots), HKV, D)), jnp.float32)
    return md, q, kk, vv, jnp.asarray(slots, jnp.int32)


def _write_then_attend(backend, md, q, k, v, slots, **kw):
    cache = jnp.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK, HKV, D), jnp.float32)
    write_md = AttentionMetadata(slots, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    cache = backend.write_kv(cache, k, v, write_md)
    return backend.attend(q, cache, md, **kw)


@pytest.mark.parametrize("backend", [PallasTPUBackend(True), PallasGPUBackend(True)])
@pytest.mark.slow
def test_pallas_backend_matches_reference_end_to_end(backend):
    md, q, k, v, slots = _step([(9, 9), (1, 14), (5, 21)])
    kw = dict(sm_scale=D**-0.5, sliding_window=11)
    with jax.default_matmul_precision("highest"):
        want = _write_then_attend(AttentionBackend(), md, q, k, v, slots, **kw)
    got = _write_then_attend(backend, md, q, k, v, slots, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [AttentionBackend(), PallasTPUBackend(True),
                                     PallasGPUBackend(True)])
def test_write_kv_updates_the_donated_cache_in_place(backend):
    md, _, k, v, slots = _step([(3, 10)])
    md = AttentionMetadata(slots, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    cache = jnp.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK, HKV, D), jnp.float32)
    step = jax.jit(backend.write_kv, donate_argnums=0)
    hlo = step.lower(cache, k, v, md).compile().as_text()
    assert "input_output_alias" in hlo
    before = cache.unsafe_buffer_pointer()
    cache = step(cache, k, v, md)
    assert cache.unsafe_buffer_pointer() == before


@pytest.mark.parametrize("backend", [AttentionBackend(), PallasTPUBackend(True),
                                     PallasGPUBackend(True)])
@pytest.mark.slow
def test_sharded_write_and_attend_over_kv_heads_match_unsharded(backend):
    """Each device writes and reads its own kv heads (shard_map over 'model'); the
    cache comes back split as the backend declares, and the answers are the
    one-device ones."""
    md, q, k, v, slots = _step([(6, 6), (1, 17)], seed=1)
    wmd = AttentionMetadata(slots, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    kw = dict(sm_scale=D**-0.5)
    mesh = Mesh(np.asarray(jax.devices()[:HKV]), ("model",))
    sharded = ShardedAttention(backend, mesh)
    empty = jnp.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK, HKV, D), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want_cache = backend.write_kv(empty, k, v, wmd)
        want = backend.attend(q, want_cache, md, **kw)
        cache = jax.jit(sharded.write_kv)(empty, k, v, wmd)
        got = jax.jit(functools.partial(sharded.attend, **kw))(q, cache, md)
    assert cache.sharding.is_equivalent_to(
        NamedSharding(mesh, backend.kv_cache_spec("model")), cache.ndim)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [AttentionBackend(), PallasTPUBackend(True),
                                     PallasGPUBackend(True)])
@pytest.mark.slow
def test_layers_share_one_cache_by_page_offset(backend):
    """Two layers' pages in one array: layer 1 at page offset NUM_BLOCKS reads and
    writes only its own pages, and each layer attends as over a cache of its own."""
    md, q, k, v, slots = _step([(4, 13), (1, 9)], seed=2)
    wmd = AttentionMetadata(slots, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    kv = [(k, v), (v * 0.5, k + 1.0)]
    kw = dict(sm_scale=D**-0.5)
    cache = jnp.zeros(backend.kv_cache_shape(2 * NUM_BLOCKS, BLOCK, HKV, D), jnp.float32)
    for layer, (kk, vv) in enumerate(kv):
        cache = backend.write_kv(cache, kk, vv, wmd, layer * NUM_BLOCKS)
    for layer, (kk, vv) in enumerate(kv):
        got = backend.attend(q, cache, md, page_offset=layer * NUM_BLOCKS, **kw)
        want = _write_then_attend(backend, md, q, kk, vv, slots, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
        alone = jnp.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK, HKV, D), jnp.float32)
        alone = backend.write_kv(alone, kk, vv, wmd)
        pages = np.asarray(cache)[layer * NUM_BLOCKS:(layer + 1) * NUM_BLOCKS]
        np.testing.assert_array_equal(pages, np.asarray(alone))


@pytest.mark.slow
def test_gpu_backend_traces_its_kernel_once_for_every_layer(monkeypatch):
    """Each layer's attend differs only in its page offset, an input of the kernel; the
    calls share one nested program, so the kernel is traced (and lowered, compiled)
    once per step shape, not once per layer: 32 separate call sites of the Mosaic GPU
    body cost 108 s of compilation per step shape on the H100, one nested program 5 s."""
    from pallas_kernels.ragged_paged_attention import gpu

    traced = []
    real = gpu.ragged_paged_attention
    monkeypatch.setattr(gpu, "ragged_paged_attention",
                        lambda *a, **kw: traced.append(kw["page_offset"]) or real(*a, **kw))
    backend = PallasGPUBackend(True)  # its own jit cache
    md, q, _, _, _ = _step([(4, 13), (1, 9)], seed=4)
    cache = jnp.zeros(backend.kv_cache_shape(3 * NUM_BLOCKS, BLOCK, HKV, D), jnp.float32)

    @jax.jit
    def layers(q, cache):
        for layer in range(3):
            q = backend.attend(q, cache, md, sm_scale=D**-0.5, page_offset=layer * NUM_BLOCKS)
        return q

    layers(q, cache)
    assert len(traced) == 1 and isinstance(traced[0], jax.core.Tracer), traced


@pytest.mark.parametrize("backend", [AttentionBackend(), PallasTPUBackend(True),
                                     PallasGPUBackend(True)])
@pytest.mark.slow
def test_layers_update_the_shared_cache_in_place(backend):
    """Write, attend, write the next layer's pages, attend: with the one cache donated,
    the program keeps a single copy of it (no cache-sized copy in the compiled HLO)."""
    md, q, k, v, slots = _step([(3, 10), (2, 7)], seed=3)
    wmd = AttentionMetadata(slots, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    num_layers = 3

    def layers(cache, q, k, v):
        for layer in range(num_layers):
            cache = backend.write_kv(cache, k, v, wmd, layer * NUM_BLOCKS)
            o = backend.attend(q, cache, md, sm_scale=D**-0.5, page_offset=layer * NUM_BLOCKS)
            # The next layer's K/V depend on this layer's output, as in a model.
            k = k + o.mean()
        return cache, k

    shape = backend.kv_cache_shape(num_layers * NUM_BLOCKS, BLOCK, HKV, D)
    cache = jnp.zeros(shape, jnp.float32)
    step = jax.jit(layers, donate_argnums=0)
    hlo = step.lower(cache, q, k, v).compile().as_text()
    dims = ",".join(map(str, shape))
    copies = [line for line in hlo.splitlines()
              if f"f32[{dims}]" in line and (" copy(" in line or " copy-start(" in line)]
    assert not copies, copies
    before = cache.unsafe_buffer_pointer()
    cache, _ = step(cache, q, k, v)
    assert cache.unsafe_buffer_pointer() == before
