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
