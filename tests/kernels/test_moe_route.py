"""The small-step routing kernel (pallas_kernels/moe_small/routing.py), in Pallas interpret
mode on the CPU: the slots `routed_slots(*route(...))` gives (experts, count and mask
exactly, weights within float32 rounding) over decode-sized steps, shards of the experts,
padding rows holding NaN and tied logits; the expert kernels fed from it equal the same
kernels fed by the jnp routing; and the layer's small step lowered for CUDA keeps no sort,
only the three Triton calls. On a GPU (`JAX_PLATFORMS=cuda`; tests/conftest.py defaults to
the CPU) the kernels run compiled instead."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl

from jaxllm.layers.moe import SparseMoE, route, routed_expert_kernel, routed_slots
from jaxllm.layers.norm import rms_norm
from pallas_kernels.moe_small import gpu, routing
from tests.layers.test_moe import _draw

# (tokens T, experts E, top_k, renormalize, real rows, first_expert, local experts, ties):
# one decode token, a few rows, a full 16-row tile; top 1 / 2 / 8 of 8 or 128 (and of 60,
# no power of two); this device's half or quarter of the experts; no real row at all.
CASES = [
    (1, 8, 1, False, 1, 0, 8, False),
    (1, 128, 8, True, 1, 0, 128, False),
    (3, 8, 2, True, 2, 0, 8, False),
    (3, 8, 8, False, 3, 4, 4, False),
    (4, 8, 2, True, 4, 4, 4, True),
    (3, 128, 1, True, 3, 0, 32, True),
    (16, 128, 8, True, 13, 64, 64, False),
    (16, 128, 2, False, 11, 0, 128, True),
    (16, 8, 8, True, 16, 0, 8, False),
    (16, 8, 2, False, 0, 0, 8, False),
    (5, 60, 4, True, 4, 30, 30, False),
]


def _interpret() -> bool:
    """Interpret mode but on a GPU, where the compiled Triton kernels run."""
    return jax.default_backend() != "gpu"


def _logits(t, e, n, ties, seed):
    """Router logits, NaN on the padding rows (from `n` on); `ties`: whole numbers in
    [0, 3), so many experts of a row share its top-k cut."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 3, (t, e)) if ties else 4 * rng.normal(size=(t, e))
    logits = logits.astype(np.float32)
    logits[n:] = np.nan
    return logits


def _rows(t):
    """The expert kernels' row count for a step of `t` rows."""
    return max(gpu.MIN_TILE, pl.next_power_of_2(t))


@pytest.mark.parametrize("t,e,k,renormalize,n,first,local,ties", CASES)
def test_routing_kernel_gives_the_jnp_routings_slots(t, e, k, renormalize, n, first, local,
                                                     ties):
    logits = _logits(t, e, n, ties, seed=t * e + k)
    rows = _rows(t)
    got = jax.jit(lambda lg, f, m: routing.route_slots(lg, k, renormalize, local, rows, f, m,
                                                        interpret=_interpret()))(logits, first, n)
    want = jax.jit(lambda lg, f, m: routed_slots(*route(lg, k, renormalize), f, local, m))(
        logits, first, n)
    experts, count, weights, mask = map(np.asarray, got)
    w_experts, w_count, w_weights, w_mask = map(np.asarray, want)
    assert count.shape == (1,) and int(count[0]) == int(w_count)
    assert (int(w_count) > 0) == (n > 0)
    np.testing.assert_array_equal(experts, w_experts)
    assert mask.shape == weights.shape == (experts.size, rows)
    np.testing.assert_array_equal(mask[:, :t], w_mask.astype(np.int32))
    np.testing.assert_allclose(weights[:, :t], w_weights, rtol=1e-6, atol=0)
    assert not mask[:, t:].any() and not weights[:, t:].any()  # the kernels' extra rows
    if ties:  # some real row's top-k cut falls inside a run of equal logits
        ranked = np.sort(logits[:n], axis=1)[:, ::-1]
        assert (ranked[:, k - 1] == ranked[:, k]).any()


def test_tied_experts_go_to_the_lower_index_as_lax_top_k_orders_them():
    """Equal logits: the lowest-indexed experts of the tie are routed to, here experts
    0 and 1 of a row of 8 zeros, and 2 (the larger logit) then 0 of the second row."""
    logits = np.zeros((2, 8), np.float32)
    logits[1, 2] = 1.0
    experts, count, weights, mask = map(np.asarray, routing.route_slots(
        logits, 2, False, 8, 16, interpret=_interpret()))
    assert int(count[0]) == 3
    np.testing.assert_array_equal(experts, [0, 1, 2, 8])
    np.testing.assert_array_equal(mask[:, :2], [[1, 1], [1, 0], [0, 1], [0, 0]])
    np.testing.assert_allclose(weights[:3, :2], [[1 / 8, 1 / (np.e + 7)], [1 / 8, 0],
                                                 [0, np.e / (np.e + 7)]], rtol=1e-6)


def test_bad_routing_arguments_are_refused():
    logits = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        routing.route_slots(logits, 9, True, 8, 16, interpret=True)
    with pytest.raises(ValueError, match="rows=12 must be a power of two"):
        routing.route_slots(logits, 2, True, 8, 12, interpret=True)
    h, router = np.zeros((17, 32), np.float32), np.zeros((8, 32), np.float32)
    with pytest.raises(ValueError, match="17 rows: at most 16"):
        routing.norm_route_slots(h, h[0], router, 1e-6, 2, True, 8, 32, interpret=True)


@pytest.mark.parametrize("t,k,renormalize,n,first", [(1, 2, True, 1, 0), (5, 3, False, 4, 4),
                                                     (16, 8, True, 13, 0)])
def test_kernels_from_logits_equal_the_kernels_from_the_jnp_routing(t, k, renormalize, n,
                                                                    first):
    """`moe_small_from_logits` (routing kernel, x read unpadded) equals `moe_small` fed by
    `route` and `routed_slots`, whatever the padding rows of x and the logits hold."""
    x, _, _, gate_up, down = _draw(t=t, e=8, k=k, h=32, i=48, seed=t + k)
    x[n:] = np.nan
    logits = _logits(t, 8, n, False, seed=t)
    local = 4 if first else 8
    gate_up, down = gate_up[first:first + local], down[first:first + local]
    got = np.asarray(jax.jit(lambda *a: gpu.moe_small_from_logits(
        *a, k, renormalize, first, n, interpret=_interpret()))(x, logits, gate_up, down))
    weights, ids = route(logits, k, renormalize)
    want = np.asarray(jax.jit(lambda *a: routed_expert_kernel(
        *a, first_expert=first, num_tokens=n, interpret=_interpret()))(
        x, weights, ids, gate_up, down))
    assert np.abs(want[:n]).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not got[n:].any()


def test_the_layers_small_step_lowers_for_cuda_with_no_sort():
    """The layer's small step at the Qwen3-30B-A3B shape (128 experts, top 8, H 2048,
    I 768), 16 rows, its kernels chosen and lowered for CUDA on this CPU host: the router
    product, then three Triton calls (routing, gate/up, down) and no sort or loop."""
    t, e, h, i = 16, 128, 2048, 768

    def make():
        layer = SparseMoE(num_experts=e, top_k=8, intermediate_size=i, hidden_size=h,
                          renormalize=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        layer.small_kernel, layer.kernel_interpret = "pallas", False
        return layer

    graphdef, state = nnx.split(nnx.eval_shape(make))
    step = jax.jit(lambda s, x, n: nnx.merge(graphdef, s)(x, None, n))
    text = step.trace(state, jax.ShapeDtypeStruct((t, h), jnp.bfloat16),
                      jax.ShapeDtypeStruct((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 3
    assert "moe_small_route" in text
    assert "sort" not in text and "stablehlo.while" not in text


def _hidden(t, h, n, seed):
    """A residual stream of `t` rows (NaN from row `n` on) and an RMSNorm weight."""
    rng = np.random.default_rng(seed)
    x = (3 * rng.normal(size=(t, h))).astype(np.float32)
    x[n:] = np.nan
    return x, (1 + 0.2 * rng.normal(size=h)).astype(np.float32)


@pytest.mark.parametrize("t,e,k,renormalize,n,first,local,ties",
                         [c for c in CASES if c[0] <= routing.NORM_ROUTE_MAX_TOKENS])
def test_norm_route_kernel_gives_the_slots_of_the_normed_inputs_logits(
        t, e, k, renormalize, n, first, local, ties):
    """`norm_route_slots` (norm, router product and routing in one kernel, the norm's
    factor deferred past the product, partial sums written by 64-column programs and
    summed by the last to take its ticket) against `route_slots` of XLA's `rms_norm` and
    router einsum in float32: the same experts, count and mask, weights to float32
    rounding, rms_norm's factor and `h * w`."""
    del ties  # the logits here come from a product; ties are the route kernel's cases
    h = 128
    x, norm = _hidden(t, h, n, seed=t * e + k)
    # Logits of order one: float32 sums in another order move them by ~1e-7 each.
    router = (np.random.default_rng(e + k).normal(size=(e, h)) / np.sqrt(h)).astype(np.float32)
    rows, eps = _rows(t), 1e-6
    got = jax.jit(lambda x, w, r, f, m: routing.norm_route_slots(
        x, w, r, eps, k, renormalize, local, rows, f, m, interpret=_interpret()))(
        x, norm, router, first, n)
    logits = jnp.einsum("th,eh->te", rms_norm(jnp.asarray(x), jnp.asarray(norm), eps), router,
                        precision="highest")
    want = routing.route_slots(logits, k, renormalize, local, rows, first, n,
                               interpret=_interpret())
    *slots, scale, hw = map(np.asarray, got)
    for g, w in zip(slots[:2] + slots[3:], want[:2] + want[3:], strict=True):
        np.testing.assert_array_equal(g, np.asarray(w))
    np.testing.assert_allclose(slots[2], np.asarray(want[2]), rtol=1e-5, atol=1e-7)
    x64 = x[:n].astype(np.float64)
    assert scale.shape == (rows,)
    np.testing.assert_allclose(scale[:n], 1 / np.sqrt((x64 ** 2).mean(1) + eps), rtol=1e-6)
    np.testing.assert_array_equal(hw[:n], x[:n] * norm)  # the gate/up kernel's input


@pytest.mark.parametrize("t,n,first,dtype", [(1, 1, 0, jnp.float32), (4, 3, 4, jnp.float32),
                                             (16, 13, 0, jnp.float32),
                                             (3, 3, 0, jnp.bfloat16)])
def test_kernels_from_the_hidden_state_equal_the_kernels_from_the_normed_logits(t, n, first,
                                                                                dtype):
    """`moe_small_from_hidden` (the norm's factor applied to the gate/up products) equals
    `moe_small_from_logits` fed XLA's `rms_norm` and router product: float32 to rounding;
    bfloat16 within a bf16 rounding of the output's scale (the gate/up input is rounded
    as `h * w` rather than as `w * (h * factor)`)."""
    k, e, h = 2, 8, 32
    _, _, _, gate_up, down = _draw(t=t, e=e, k=k, h=h, i=48, seed=t + 3)
    x, norm = _hidden(t, h, n, seed=t)
    router = (0.1 * np.random.default_rng(t).normal(size=(e, h))).astype(np.float32)
    local = 4 if first else 8
    gate_up, down = gate_up[first:first + local], down[first:first + local]
    x, norm, router, gate_up, down = (jnp.asarray(a, dtype)
                                      for a in (x, norm, router, gate_up, down))
    got = np.asarray(jax.jit(lambda *a: gpu.moe_small_from_hidden(
        a[0], a[1], 1e-6, *a[2:], k, True, first, n, interpret=_interpret()))(
        x, norm, router, gate_up, down))
    xn = rms_norm(x, norm, 1e-6)
    logits = jnp.einsum("th,eh->te", xn, router, preferred_element_type=jnp.float32,
                        precision="highest")
    want = np.asarray(jax.jit(lambda *a: gpu.moe_small_from_logits(
        *a, k, True, first, n, interpret=_interpret()))(xn, logits, gate_up, down))
    assert np.abs(want[:n]).max() > 0.1 and not got[n:].any()
    atol = 1e-5 if dtype == jnp.float32 else 2e-2 * np.abs(want[:n]).max()
    np.testing.assert_allclose(got[:n], want[:n], rtol=0, atol=atol)


def test_the_layers_small_step_from_the_hidden_state_lowers_for_cuda():
    """Given its norm, the layer's small step at the Qwen3-30B-A3B shape lowers for CUDA as
    three Triton calls (norm and routing, gate/up, down) with no product, sort or loop
    around them."""
    t, e, h, i = 16, 128, 2048, 768

    def make():
        layer = SparseMoE(num_experts=e, top_k=8, intermediate_size=i, hidden_size=h,
                          renormalize=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        layer.small_kernel, layer.kernel_interpret = "pallas", False
        return layer

    graphdef, state = nnx.split(nnx.eval_shape(make))
    step = jax.jit(lambda s, x, n, w: nnx.merge(graphdef, s)(x, x, n, norm=(w, 1e-6)))
    text = step.trace(state, jax.ShapeDtypeStruct((t, h), jnp.bfloat16),
                      jax.ShapeDtypeStruct((), jnp.int32),
                      jax.ShapeDtypeStruct((h,), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 3
    assert "moe_small_norm_route" in text
    assert "stablehlo.dot_general" not in text and "sort" not in text
    assert "stablehlo.while" not in text
