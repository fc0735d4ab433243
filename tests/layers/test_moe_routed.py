"""The mixture-of-experts layer's small-step path (`routed_expert_ffn`): it loops over the
distinct experts the real tokens routed to, equals the grouped-matmul path on the real
rows, gives padding rows nothing and lets them change nothing, float and quantized, on
one device and expert parallel over fake CPU devices; the layer picks it by the step's
row count at trace time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.distributed.mesh import make_mesh, param_shardings
from jaxllm.errors import ParameterError
from jaxllm.layers.grouped_matmul import GroupedMatmul
from jaxllm.layers.moe import (
    SMALL_TOKENS,
    SparseMoE,
    expert_ffn,
    routed_expert_ffn,
    small_step_kernel,
    small_token_limit,
)
from jaxllm.layers.moe_routing import routed_experts
from jaxllm.layers.quant import Fp8Linear, linear_method, quantize_per_channel
from tests.jaxprs import equations
from tests.layers.test_moe import (
    QUANTIZED_EXPERTS,
    _draw,
    dense_reference,
    quantized_reference,
)

GMM = GroupedMatmul("ragged_dot")


@pytest.mark.parametrize("first,local,num_tokens", [(0, 8, 6), (4, 4, 6), (0, 8, 0),
                                                    (2, 2, 8)])
def test_routed_experts_are_the_real_tokens_distinct_local_experts(first, local, num_tokens):
    """Each expert once however many tokens pick it, none picked only by padding tokens
    (rows from `num_tokens` on) or held by another device, then `local` as fill."""
    ids = np.array([[0, 1], [1, 5], [5, 0], [7, 1], [1, 0], [5, 7], [2, 3], [6, 3]], np.int32)
    experts, count = jax.jit(routed_experts, static_argnums=2)(ids, first, local, num_tokens)
    real = ids[:num_tokens].reshape(-1)
    want = np.unique(real[(real >= first) & (real < first + local)]) - first
    assert want.size < min(ids.size, local) or num_tokens == 8  # something is left out
    assert int(count) == want.size
    np.testing.assert_array_equal(np.asarray(experts)[:want.size], want)
    assert (np.asarray(experts)[want.size:] == local).all()
    assert experts.shape == (min(ids.size, local),)


@pytest.mark.parametrize("t,e,k,n", [(8, 8, 2, 6), (16, 4, 4, 16), (8, 8, 8, 1), (1, 8, 2, 1),
                                     (12, 6, 3, 5)])
def test_routed_path_equals_the_grouped_path_and_padding_rows_change_nothing(t, e, k, n):
    """Real rows: the grouped matmul's and the dense einsum's values (experts picked by
    several tokens, every expert for every token, one decode token over every expert);
    padding rows: zero, and NaN there leaves every real row as it was."""
    x, weights, ids, gate_up, down = _draw(t=t, e=e, k=k, seed=t + n)
    routed = jax.jit(lambda *a: routed_expert_ffn(*a[:5], num_tokens=a[5]))
    got = np.asarray(routed(x, weights, ids, gate_up, down, n))
    grouped = np.asarray(jax.jit(lambda *a: expert_ffn(*a[:5], GMM, num_tokens=a[5]))(
        x, weights, ids, gate_up, down, n))
    want = dense_reference(x, weights, ids, gate_up, down)
    assert np.abs(want[:n]).max() > 0.5
    np.testing.assert_allclose(got[:n], want[:n], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[:n], grouped[:n], rtol=0, atol=1e-5)
    assert not got[n:].any() and not grouped[n:].any()
    poisoned = x.copy()
    poisoned[n:] = np.nan
    np.testing.assert_array_equal(np.asarray(routed(poisoned, weights, ids, gate_up, down, n)),
                                  got)


def test_routed_halves_sum_to_all_experts():
    """`first_expert`: each half of the experts computes only its own pairs (the
    expert-parallel psum adds them)."""
    x, weights, ids, gate_up, down = _draw(t=8, e=8, k=3, seed=3)
    half = jax.jit(lambda *a: routed_expert_ffn(*a[:5], a[5], num_tokens=7))
    halves = [np.asarray(half(x, weights, ids, gate_up[s:s + 4], down[s:s + 4], s))
              for s in (0, 4)]
    assert all(np.abs(part).max() > 0.1 for part in halves)
    want = dense_reference(x, weights, ids, gate_up, down)
    np.testing.assert_allclose((halves[0] + halves[1])[:7], want[:7], rtol=0, atol=1e-5)
    assert not (halves[0] + halves[1])[7:].any()


@pytest.mark.parametrize("case", list(QUANTIZED_EXPERTS))
def test_quantized_routed_path_equals_the_grouped_path(case):
    """int8 / fp8 (W8A8 and weight-only) experts through `method.product` per expert:
    the grouped path's values and the dense einsum's over the dequantized weights."""
    kind, method, rounds = QUANTIZED_EXPERTS[case]
    x, weights, ids, gate_up, down = _draw(t=8, e=8, k=2, seed=4)
    gu_q, gu_s = quantize_per_channel(gate_up, 1, kind)
    dn_q, dn_s = quantize_per_channel(down, 1, kind)
    got = np.asarray(jax.jit(lambda *a: routed_expert_ffn(*a[:5], 0, method, *a[5:],
                                                          num_tokens=6))(
        x, weights, ids, gu_q, dn_q, gu_s, dn_s))
    grouped = np.asarray(jax.jit(lambda *a: expert_ffn(*a[:5], GMM, 0, method, *a[5:]))(
        x, weights, ids, gu_q, dn_q, gu_s, dn_s))
    want = quantized_reference(x, weights, ids, gate_up, down, kind, rounds)
    assert np.abs(want - dense_reference(x, weights, ids, gate_up, down)).max() > 1e-3
    np.testing.assert_allclose(got[:6], want[:6], rtol=0, atol=1e-4)
    np.testing.assert_allclose(got[:6], grouped[:6], rtol=0, atol=1e-5)
    assert not got[6:].any()


def _layers(mesh=None, **kw):
    kw = {**dict(num_experts=8, top_k=3, intermediate_size=48, hidden_size=32,
                 renormalize=True, dtype=jnp.float32), **kw}
    return SparseMoE(rngs=nnx.Rngs(0), mesh=mesh, **kw)


def _call(layer, x, residual, num_tokens):
    graphdef, state = nnx.split(layer)
    if layer.mesh is not None:
        state = jax.device_put(nnx.to_pure_dict(state), param_shardings(state, layer.mesh))
    fn = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))
    return fn(state, x, residual, num_tokens), jax.make_jaxpr(fn)(state, x, residual, num_tokens)


@pytest.mark.parametrize("method", [None, "int8"])
def test_layer_takes_the_routed_path_for_small_steps_with_the_grouped_paths_values(method):
    """A step of at most `small_tokens` rows loops (a while in its program), a larger
    one does not; both give the same real rows and only the residual on padding rows."""
    m = linear_method(method)
    small, large = _layers(method=m), _layers(method=m)
    large.small_tokens = 0
    x = jnp.asarray(np.random.default_rng(5).normal(size=(8, 32)), jnp.float32)
    residual = jnp.ones_like(x)
    got, small_jaxpr = _call(small, x, residual, jnp.int32(5))
    want, large_jaxpr = _call(large, x, residual, jnp.int32(5))
    assert "while" in str(small_jaxpr) and "while" not in str(large_jaxpr)
    assert np.abs(np.asarray(want)[:5] - 1).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[5:], 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, Fp8Linear(weight_only_tokens=0)],
                         ids=["float", "fp8"])
def test_expert_parallel_routed_path_equals_one_device(method):
    """At tp 2 (2 fake devices, 4 experts each) each device loops over its own routed
    experts and the psum adds the halves: one device's values, padding rows untouched."""
    one, split = _layers(method=method), _layers(mesh=make_mesh(2), method=method)
    assert one.small_tokens == split.small_tokens == SMALL_TOKENS
    x = jnp.asarray(np.random.default_rng(6).normal(size=(8, 32)), jnp.float32)
    residual = jnp.ones_like(x)
    want, _ = _call(one, x, residual, jnp.int32(6))
    got, jaxpr = _call(split, x, residual, jnp.int32(6))
    assert "while" in str(jaxpr) and got.sharding.is_fully_replicated
    assert np.abs(np.asarray(want)[:6] - 1).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[6:], 1.0)


def test_small_token_limit_reads_its_environment_variable(monkeypatch):
    monkeypatch.delenv("JAXLLM_MOE_SMALL_TOKENS", raising=False)
    assert small_token_limit() == SMALL_TOKENS  # on the CPU
    monkeypatch.setenv("JAXLLM_MOE_SMALL_TOKENS", "0")
    assert small_token_limit() == 0 and _layers().small_tokens == 0
    monkeypatch.setenv("JAXLLM_MOE_SMALL_TOKENS", "sixteen")
    with pytest.raises(ParameterError, match="JAXLLM_MOE_SMALL_TOKENS: must be a whole"):
        small_token_limit()


def _outside_kernels(jaxpr) -> list[str]:
    """The primitives a program runs, nested programs included, kernels' bodies not."""
    return [eqn.primitive.name for eqn in equations(jaxpr, kernels=False)]


def test_small_step_kernel_reads_its_environment_variable(monkeypatch):
    monkeypatch.delenv("JAXLLM_MOE_SMALL_KERNEL", raising=False)
    assert small_step_kernel() == "loop"  # on the CPU
    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", "pallas")
    assert small_step_kernel() == "pallas" and _layers().small_kernel == "pallas"
    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", "fused")
    with pytest.raises(ParameterError, match="JAXLLM_MOE_SMALL_KERNEL: must be one of loop"):
        small_step_kernel()


@pytest.mark.parametrize("method,inter", [(None, 48), ("int8", 48), (None, 40)])
def test_layer_takes_the_fused_kernel_for_small_float_steps_only(method, inter, monkeypatch):
    """With the kernel chosen, a small step of float experts runs three pallas_calls
    (routing, gate/up, down) and no loop, top-k or sort (interpret mode on the CPU) with
    the loop's values; quantized experts, and an intermediate size off the kernel's
    16-wide tiles, keep the loop and `route`'s top-k."""
    m = linear_method(method)
    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", "loop")
    looped = _layers(method=m, intermediate_size=inter)
    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", "pallas")
    fused = _layers(method=m, intermediate_size=inter)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(8, 32)), jnp.float32)
    residual = jnp.ones_like(x)
    want, _ = _call(looped, x, residual, jnp.int32(5))
    got, jaxpr = _call(fused, x, residual, jnp.int32(5))
    ops = _outside_kernels(jaxpr.jaxpr)
    if method is None and inter % 16 == 0:
        assert ops.count("pallas_call") == 3 and "while" not in ops
        assert "top_k" not in ops and "sort" not in ops
    else:
        assert "pallas_call" not in ops and "while" in ops and "top_k" in ops
    assert np.abs(np.asarray(want)[:5] - 1).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[5:], 1.0)


@pytest.mark.slow
def test_expert_parallel_fused_kernel_equals_one_device_loop(monkeypatch):
    """At tp 2 (2 fake devices, 4 experts each) each device's kernels route to and read
    only its own experts and the psum adds the halves: one device's loop values."""
    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", "loop")
    one = _layers()
    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", "pallas")
    split = _layers(mesh=make_mesh(2))
    x = jnp.asarray(np.random.default_rng(8).normal(size=(8, 32)), jnp.float32)
    residual = jnp.ones_like(x)
    want, _ = _call(one, x, residual, jnp.int32(6))
    got, jaxpr = _call(split, x, residual, jnp.int32(6))
    ops = _outside_kernels(jaxpr.jaxpr)
    assert ops.count("pallas_call") == 3 and "while" not in ops and "top_k" not in ops
    assert got.sharding.is_fully_replicated
    assert np.abs(np.asarray(want)[:6] - 1).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[6:], 1.0)
