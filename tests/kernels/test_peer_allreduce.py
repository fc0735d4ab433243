"""The peer all-reduce kernel (pallas_kernels/peer_allreduce) and its route's choices.

The kernel writes into other GPUs' memory by address, which no interpret mode can
stand in for: its tests run where several CUDA GPUs are visible (the device machines,
`JAX_PLATFORMS=cuda python3 -m pytest tests/kernels/test_peer_allreduce.py`), against a
float32 `psum` rounded once, as the kernel rounds. On CPU the sizes it takes and the
choice of route are checked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.layers import row_reduce
from jaxllm.layers.norm import rms_norm
from pallas_kernels.peer_allreduce import add_norm, gpu


def _struct(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_sizes_the_kernel_takes():
    # A decode step's sums: a few rows of the hidden size, bfloat16 or float32.
    assert gpu.supported(_struct((1, 4096)))
    assert gpu.supported(_struct((8, 8192)))
    assert gpu.supported(_struct((8, 2048), jnp.float32))
    assert gpu.supported(_struct((1, 64)))  # one chunk of a power of two
    # Up to the workspace's size, then XLA's all-reduce.
    assert gpu.supported(_struct((1, 2 * gpu.MAX_WORDS)))
    assert not gpu.supported(_struct((2, 2 * gpu.MAX_WORDS)))
    assert not gpu.supported(_struct((1, gpu.MAX_WORDS + gpu.CHUNK), jnp.float32))
    # Not whole chunks, an odd bfloat16 size, other dtypes.
    assert not gpu.supported(_struct((3, gpu.CHUNK + 2)))
    assert not gpu.supported(_struct((1, 3)))
    assert not gpu.supported(_struct((1, 48)))
    assert not gpu.supported(_struct((1, 4096), jnp.float16))
    assert not gpu.supported(_struct((1, 4096), jnp.int32))


def test_workspace_layout_keeps_counters_and_data_apart():
    for ranks in (2, 4, 8):
        layout = gpu.Layout(ranks)
        slots = gpu.MAX_WORDS // gpu.CHUNK
        assert layout.data == slots  # the counters come first, one a program
        assert layout.words == layout.data + 3 * ranks * gpu.MAX_WORDS
        start = layout.initial()
        assert start.shape == (layout.words,) and start.dtype == np.int32
        assert (start[:slots] == 0).all() and (start[slots:] == gpu.SENTINEL).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_no_word_sent_is_the_sentinel(dtype):
    """A word that lands in a receive buffer is its own arrival signal, so none may equal
    the sentinel a buffer holds before: a -0.0 that would make it (a float32, or the high
    half of a bfloat16 pair) is sent as +0.0, every other value bit for bit."""
    values = np.array([-0.0, -0.0, 1.5, -2.25, 0.0, -0.0, -0.0, 3.0], np.float32)
    x = jnp.asarray(values, dtype)
    pairs = dtype == jnp.bfloat16
    words = jax.lax.bitcast_convert_type(x.reshape(-1, 2) if pairs else x, jnp.int32)
    sent = gpu.sendable(words, pairs)
    assert not (np.asarray(sent) == gpu.SENTINEL).any()
    expected = np.array(x)  # a pair's second element is its word's high half
    high = np.arange(values.size) % 2 == 1 if pairs else np.ones(values.size, bool)
    expected[high & (values == 0)] = 0.0
    back = jax.lax.bitcast_convert_type(sent, dtype).reshape(-1)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), expected.view(np.uint8))
    assert np.signbit(np.asarray(back, np.float32)[0]) == pairs  # a low half's -0.0 stays


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU suite's fake devices")
def test_route_on_cpu_devices(monkeypatch):
    """XLA's all-reduce on CPU devices, and at tp 1; the `psum` stand-in on request."""
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("model",))
    one = Mesh(np.asarray(jax.devices()[:1]), ("model",))
    monkeypatch.delenv(row_reduce.ENV, raising=False)
    assert row_reduce.make(mesh) is None and row_reduce.make(one) is None
    monkeypatch.setenv(row_reduce.ENV, "psum")
    reduce = row_reduce.make(mesh)
    assert reduce.mode == "psum" and reduce.ranks == 2 and row_reduce.make(one) is None
    assert reduce.takes(8, 4096, jnp.bfloat16) and not reduce.takes(4096, 4096, jnp.bfloat16)
    monkeypatch.setenv(row_reduce.ENV, "0")
    assert row_reduce.make(mesh) is None


def _gpus() -> list:
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


needs_gpus = pytest.mark.skipif(len(_gpus()) < 2, reason="writes into other GPUs' memory: "
                                "needs two or more CUDA GPUs")


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    if request.param > len(_gpus()):
        pytest.skip(f"{request.param} GPUs")
    return request.param


def _programs(ranks: int):
    mesh = Mesh(np.asarray(_gpus()[:ranks]), ("x",))
    ws = gpu.Workspace(mesh, "x")

    def sm(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                                     check_vma=False))

    return (mesh, ws, sm(lambda b, t: gpu.all_reduce(b, t, "x", ranks)),
            sm(lambda b, t: jax.lax.psum(b.astype(jnp.float32), "x").astype(b.dtype)))


@needs_gpus
@pytest.mark.parametrize("shape,dtype", [((1, 4096), jnp.bfloat16), ((8, 8192), jnp.bfloat16),
                                         ((1, 64), jnp.bfloat16), ((32, 4096), jnp.bfloat16),
                                         ((8, 2048), jnp.float32), ((1, 256), jnp.float32)])
def test_kernel_sums_as_float32_psum(ranks, shape, dtype):
    mesh, ws, mine, want = _programs(ranks)
    x = jax.random.normal(jax.random.key(shape[0] * shape[1]), (ranks * shape[0], shape[1]))
    x = jax.device_put(x.astype(dtype), NamedSharding(mesh, P("x")))
    got = np.asarray(mine(x, ws.table), np.float32)
    np.testing.assert_array_equal(got, np.asarray(want(x, ws.table), np.float32))
    # Every rank holds the same sum.
    rows = got.reshape(ranks, *shape)
    assert all((rows[r] == rows[0]).all() for r in range(ranks))


@needs_gpus
def test_kernel_stays_exact_over_thousands_of_chained_calls(ranks):
    """The counters and the three buffers, call after call: ones summed and scaled back
    stay ones through 64 calls a program, run 50 times."""
    mesh = Mesh(np.asarray(_gpus()[:ranks]), ("x",))
    ws = gpu.Workspace(mesh, "x")

    def chain(b, t):
        for _ in range(64):
            b = gpu.all_reduce(b, t, "x", ranks) * jnp.bfloat16(1.0 / ranks)
        return b

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                              check_vma=False))
    y = jax.device_put(jnp.ones((ranks * 2, 4096), jnp.bfloat16), NamedSharding(mesh, P("x")))
    for _ in range(50):
        y = f(y, ws.table)
    assert (np.asarray(y, np.float32) == 1).all()


@needs_gpus
def test_kernel_mixes_sizes_and_signed_zeros_call_after_call(ranks):
    """Calls of different sizes share the programs' counters and buffers (a call of fewer
    words than a chunk, then whole chunks, bfloat16 and float32), and zeros of either
    sign sit among the values (a -0.0 is the bits of the buffers' sentinel, and must
    still land): every sum is the ranks' values added in rank order in float32 and
    rounded once, round after round. (XLA combines the psums of one program into one
    all-reduce whose order of addition differs, so a float32 psum is no oracle here.)"""
    mesh = Mesh(np.asarray(_gpus()[:ranks]), ("x",))
    ws = gpu.Workspace(mesh, "x")
    cases = [((1, 64), jnp.bfloat16), ((8, 4096), jnp.bfloat16), ((1, 256), jnp.float32),
             ((32, 4096), jnp.bfloat16), ((8, 2048), jnp.float32)]

    def each(f):
        return jax.jit(jax.shard_map(lambda t, *xs: tuple(f(x, t) for x in xs), mesh=mesh,
                                     in_specs=(P(), *[P("x")] * len(cases)),
                                     out_specs=tuple(P("x") for _ in cases), check_vma=False))

    mine = each(lambda x, t: gpu.all_reduce(x, t, "x", ranks))
    rng = np.random.default_rng(0)
    for _ in range(20):
        xs, wants = [], []
        for shape, dtype in cases:
            v = rng.standard_normal((ranks * shape[0], shape[1])).astype(np.float32)
            v[rng.random(v.shape) < 0.3] = -0.0
            v[:, :8] = -0.0  # on every rank: the sum is a zero too
            x = jnp.asarray(v, dtype)
            total = np.zeros(shape, np.float32)
            for part in np.asarray(x, np.float32).reshape(ranks, *shape):
                total = total + part
            wants.append(np.asarray(jnp.asarray(np.tile(total, (ranks, 1)), dtype), np.float32))
            xs.append(jax.device_put(x, NamedSharding(mesh, P("x"))))
        for got, want in zip(mine(ws.table, *xs), wants, strict=True):
            np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_rows_the_add_norm_kernel_takes():
    # A row is a power of two of words: bfloat16 in pairs, float32 one a word.
    assert add_norm.row_words(4096, jnp.bfloat16) == 2048
    assert add_norm.row_words(2048, jnp.float32) == 2048
    assert add_norm.row_words(3584, jnp.bfloat16) == 0  # Gemma-2-9B: the unfused path
    assert add_norm.row_words(64, jnp.float16) == 0
    assert add_norm.supported(8, 4096, jnp.bfloat16)
    assert add_norm.supported(32, 4096, jnp.bfloat16)
    assert not add_norm.supported(33, 4096, jnp.bfloat16)  # past the workspace
    assert add_norm.supported(add_norm.MAX_ROWS, 64, jnp.float32)  # a program a row
    assert not add_norm.supported(add_norm.MAX_ROWS + 1, 64, jnp.float32)


def _add_norm_want(parts: np.ndarray, residual, weight, dtype, offset: bool):
    """The unfused path: the ranks' float32 sum in rank order rounded once, the residual
    add, then `rms_norm` as the model runs it."""
    total = np.zeros(parts.shape[1:], np.float32)
    for part in parts:
        total = total + part
    x = residual + jnp.asarray(total, dtype)
    return np.asarray(x, np.float32), np.asarray(rms_norm(x, weight, 1e-6, offset), np.float32)


@needs_gpus
@pytest.mark.parametrize("shape,dtype,offset,split", [
    ((8, 4096), jnp.bfloat16, False, 0), ((1, 4096), jnp.bfloat16, True, 0),
    ((16, 8192), jnp.bfloat16, False, 0), ((8, 2048), jnp.float32, False, 0),
    ((4, 64), jnp.float32, True, 0), ((3, 256), jnp.bfloat16, False, 0),
    ((8, 4096), jnp.bfloat16, False, 4), ((1, 4096), jnp.bfloat16, True, 2),
    ((8, 2048), jnp.float32, False, 3), ((3, 256), jnp.bfloat16, False, 4)])
def test_add_norm_kernel_is_the_sum_then_the_add_then_the_norm(ranks, shape, dtype, offset,
                                                              split):
    """Calls of one row width, over and over on one workspace, the weight a row of a
    table: the sum and the add are the unfused path's bits; the norm is within one
    rounding of it (its mean adds in another order). Rows of one chunk and of several.
    `split`: each rank's partial as that many float32 partials of a split-K product,
    which the kernel adds in order and rounds to the model dtype before the sum."""
    mesh = Mesh(np.asarray(_gpus()[:ranks]), ("x",))
    ws = gpu.Workspace(mesh, "x")
    lead = P(None, "x") if split else P("x")
    mine = jax.jit(jax.shard_map(
        lambda b, r, w, t: add_norm.all_reduce_add_norm(b, r, w, 2, 1e-6, offset, t, "x",
                                                        ranks),
        mesh=mesh, in_specs=(lead, P(), P(), P()), out_specs=(P(), P()), check_vma=False))
    rng = np.random.default_rng(shape[0] + split)
    for _ in range(20):
        splits = rng.standard_normal((max(split, 1), ranks, *shape)).astype(np.float32)
        splits[:, :, :, :4] = -0.0  # the sentinel's bits must still land
        if split:  # each rank's partial: its splits added in order, then rounded
            total = splits[0]
            for more in splits[1:]:
                total = total + more
            x = jnp.asarray(splits.reshape(split, -1, shape[1]))
        else:
            total = splits[0]
            x = jnp.asarray(total.reshape(-1, shape[1]), dtype)
        parts = np.asarray(jnp.asarray(total, dtype), np.float32)
        residual = jnp.asarray(rng.standard_normal(shape), dtype)
        weights = jnp.asarray(rng.standard_normal((3, shape[1])), dtype)
        x = jax.device_put(x, NamedSharding(mesh, lead))
        got_x, got_n = (np.asarray(v, np.float32) for v in mine(x, residual, weights, ws.table))
        want_x, want_n = _add_norm_want(parts, residual, weights[2], dtype, offset)
        np.testing.assert_array_equal(got_x, want_x)
        ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20
        np.testing.assert_allclose(got_n, want_n, rtol=ulp, atol=ulp)
