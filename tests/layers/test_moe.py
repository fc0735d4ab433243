"""The mixture-of-experts layer: routing as transformers routes, and the grouped matmul by
megablox and the Pallas GPU kernel (Pallas interpret mode), ragged_dot and the tiled XLA
body equal to a dense per-expert einsum, on one device and expert parallel over fake CPU
devices, with float and with int8 / fp8 quantized expert weights."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from jaxllm.distributed.mesh import make_mesh, param_shardings
from jaxllm.errors import ParameterError
from jaxllm.layers.grouped_matmul import GroupedMatmul, default_grouped_matmul
from jaxllm.layers.moe import SparseMoE, expert_ffn, route
from jaxllm.layers.quant import (
    FP8_MAX,
    WEIGHT_ONLY_ENV,
    Fp8Linear,
    dequantize,
    linear_method,
    quantize_per_channel,
)
from jaxllm.models.moe_weights import MoEArch

KERNELS = [GroupedMatmul("ragged_dot"), GroupedMatmul("megablox", interpret=True),
           GroupedMatmul("tiled"), GroupedMatmul("pallas_gpu", interpret=True)]


def dense_reference(x, weights, ids, gate_up, down):
    """Every expert on every token (einsum), then each token's top-k mixed by a one-hot."""
    h = np.einsum("th,esih->tesi", x, gate_up)
    act = h[:, :, 0] / (1 + np.exp(-h[:, :, 0])) * h[:, :, 1]
    every = np.einsum("tei,ehi->teh", act, down)
    mix = np.zeros(every.shape[:2])
    np.put_along_axis(mix, ids, weights, axis=1)  # ids distinct per token
    return np.einsum("te,teh->th", mix, every)


def _draw(t=24, e=8, k=2, h=32, i=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(t, h)).astype(np.float32)
    logits = rng.normal(size=(t, e)).astype(np.float32)
    gate_up = (0.2 * rng.normal(size=(e, 2, i, h))).astype(np.float32)
    down = (0.2 * rng.normal(size=(e, h, i))).astype(np.float32)
    weights, ids = route(jnp.asarray(logits), k, renormalize=True)
    return x, np.asarray(weights), np.asarray(ids), gate_up, down


@pytest.mark.parametrize("gmm", KERNELS, ids=lambda g: g.kernel)
@pytest.mark.parametrize("t,e,k", [(24, 8, 2), (5, 4, 4), (16, 6, 1), (1, 8, 2), (200, 4, 2)])
def test_grouped_experts_equal_the_dense_per_expert_einsum(gmm, t, e, k):
    """Including tokens counts that are not a multiple of the kernel's row tile (5*4 rows),
    experts no token picks (top 1 of 6 over 16 tokens, one decode token), every expert
    for every token, and groups of several tiles (400 rows over 4 experts)."""
    x, weights, ids, gate_up, down = _draw(t=t, e=e, k=k)
    got = jax.jit(lambda *a: expert_ffn(*a, gmm))(x, weights, ids, gate_up, down)
    want = dense_reference(x, weights, ids, gate_up, down)
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("gmm", KERNELS, ids=lambda g: g.kernel)
def test_experts_split_in_two_sum_to_all_experts(gmm):
    """Each half of the experts (`first_expert`) computes only its pairs; the halves add
    up to the whole, which is what the expert-parallel psum relies on."""
    x, weights, ids, gate_up, down = _draw(seed=1)
    halves = [np.asarray(expert_ffn(x, weights, ids, gate_up[s:s + 4], down[s:s + 4], gmm, s))
              for s in (0, 4)]
    assert all(np.abs(part).max() > 0.1 for part in halves)
    np.testing.assert_allclose(halves[0] + halves[1],
                               dense_reference(x, weights, ids, gate_up, down), rtol=0,
                               atol=1e-4)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_transformers_routers(renormalize):
    """Mixtral's router (always renormalized) and Qwen3-MoE's (renormalized iff
    norm_topk_prob): the same experts and weights."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if renormalize:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8,
                                                 num_experts_per_tok=3))
    else:
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8,
                                                   num_experts_per_tok=3,
                                                   norm_topk_prob=False))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        x = torch.randn(32, 16)
        logits, want_w, want_ids = router(x)
    weights, ids = route(jnp.asarray(logits.numpy()), 3, renormalize)
    np.testing.assert_array_equal(np.asarray(ids), want_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), want_w.numpy(), rtol=0, atol=1e-6)
    sums = np.asarray(weights).sum(-1)
    assert np.allclose(sums, 1.0) == renormalize


@pytest.mark.slow
@pytest.mark.parametrize("gmm", KERNELS, ids=lambda g: g.kernel)
def test_expert_parallel_layer_equals_one_device(gmm):
    """At tp 2 each device holds 4 of the 8 experts (`shard_map`, psum over 'model'); the
    grouped matmul at every row count (tests/layers/test_moe_routed.py: small steps')."""
    kw = dict(num_experts=8, top_k=2, intermediate_size=48, hidden_size=32,
              renormalize=True, dtype=jnp.float32, gmm=gmm)
    one = SparseMoE(rngs=nnx.Rngs(0), **kw)
    mesh = make_mesh(2)
    split = SparseMoE(rngs=nnx.Rngs(0), mesh=mesh, **kw)
    one.small_tokens = split.small_tokens = 0
    graphdef, state = nnx.split(split)
    state = jax.device_put(nnx.to_pure_dict(state), param_shardings(state, mesh))
    assert state["gate_up_proj"].addressable_shards[0].data.shape == (4, 2, 48, 32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 32)), jnp.float32)
    residual = jnp.ones_like(x)
    want = np.asarray(one(x, residual))
    got = jax.jit(lambda s, x, r: nnx.merge(graphdef, s)(x, r))(state, x, residual)
    assert got.sharding.is_fully_replicated
    assert np.abs(want - 1).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


def test_experts_not_divisible_by_tp_is_a_parameter_error():
    with pytest.raises(ParameterError, match="tensor_parallel_size: 4 does not divide the 6"):
        SparseMoE(num_experts=6, top_k=2, intermediate_size=8, hidden_size=8,
                  renormalize=True, dtype=jnp.float32, rngs=nnx.Rngs(0), mesh=make_mesh(4))


def test_unknown_grouped_matmul_is_a_parameter_error(monkeypatch):
    with pytest.raises(ParameterError, match="kernel: must be one of"):
        GroupedMatmul("cutlass")
    assert default_grouped_matmul().kernel == "ragged_dot"  # on the CPU
    for platform, kernel in (("gpu", "pallas_gpu"), ("tpu", "megablox")):
        mesh = SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)]))
        assert default_grouped_matmul(mesh).kernel == kernel
    monkeypatch.setenv("JAXLLM_MOE_KERNEL", "tiled")
    assert default_grouped_matmul().kernel == "tiled"
    monkeypatch.setenv("JAXLLM_MOE_KERNEL", "cutlass")
    with pytest.raises(ParameterError, match="JAXLLM_MOE_KERNEL: must be one of"):
        default_grouped_matmul()


@pytest.mark.parametrize("step,dense", [(1, []), (1, [0, 2]), (2, []), (3, [5])])
def test_sparse_layers_follow_transformers_decoder_sparse_step_and_mlp_only_layers(step, dense):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeSparseMoeBlock,
    )

    cfg = Qwen3MoeConfig(hidden_size=8, intermediate_size=8, moe_intermediate_size=4,
                         num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=step,
                         mlp_only_layers=dense)
    want = tuple(isinstance(Qwen3MoeDecoderLayer(cfg, i).mlp, Qwen3MoeSparseMoeBlock)
                 for i in range(6))
    assert MoEArch.from_hf_config(cfg).sparse_layers == want
    assert any(want) and (not all(want) or (step == 1 and not dense))


def _fp8_rows(a: np.ndarray) -> np.ndarray:
    """Each row of `a` rounded to e4m3 at its own scale `amax / 448`, as the fp8 method
    quantizes activations, and scaled back (the value the fp8 product sees)."""
    s = np.maximum(np.abs(a).max(-1, keepdims=True), 1e-12) / FP8_MAX
    return (a / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s


def quantized_reference(x, weights, ids, gate_up, down, kind, round_activations):
    """`dense_reference` over the dequantized expert weights; with `round_activations`
    (fp8 W8A8) also each (token, expert) pair's input and hidden rows rounded to e4m3
    per row."""
    gu = dequantize(*quantize_per_channel(gate_up, 1, kind))
    dn = dequantize(*quantize_per_channel(down, 1, kind))
    if not round_activations:
        return dense_reference(x, weights, ids, gu, dn)
    h = np.einsum("th,esih->tesi", _fp8_rows(x), gu)
    act = _fp8_rows(h[:, :, 0] / (1 + np.exp(-h[:, :, 0])) * h[:, :, 1])
    every = np.einsum("tei,ehi->teh", act, dn)
    mix = np.zeros(every.shape[:2])
    np.put_along_axis(mix, ids, weights, axis=1)
    return np.einsum("te,teh->th", mix, every)


# (weight kind, method, whether it rounds activations): fp8 with a threshold at the
# 48 token-expert rows of `_draw(t=24, k=2)` runs weight-only, at 0 W8A8.
QUANTIZED_EXPERTS = {"int8": ("int8", linear_method("int8"), False),
                     "fp8": ("fp8", Fp8Linear(weight_only_tokens=0), True),
                     "fp8_weight_only": ("fp8", Fp8Linear(weight_only_tokens=48), False)}


@pytest.mark.parametrize("case", list(QUANTIZED_EXPERTS))
@pytest.mark.parametrize("gmm", [KERNELS[0]] + [pytest.param(g, marks=pytest.mark.slow)
                                                for g in KERNELS[1:]],
                         ids=lambda g: g.kernel)
def test_quantized_experts_equal_the_dense_einsum_over_dequantized_weights(gmm, case):
    """int8 / fp8 expert weights (one scale per expert and output channel) through every
    grouped-matmul body, against the float einsum over the dequantized weights (fp8
    W8A8: and over the activation rows rounded to e4m3 as the method rounds them); the
    experts split in two still sum to the whole."""
    kind, method, rounds = QUANTIZED_EXPERTS[case]
    x, weights, ids, gate_up, down = _draw(t=24, e=8, k=2)
    gu_q, gu_s = quantize_per_channel(gate_up, 1, kind)
    dn_q, dn_s = quantize_per_channel(down, 1, kind)
    assert gu_s.shape == (8, 2, 48) and dn_s.shape == (8, 32)

    def run(s, n):
        return np.asarray(jax.jit(lambda *a: expert_ffn(*a[:5], gmm, s, method, *a[5:]))(
            x, weights, ids, gu_q[s:s + n], dn_q[s:s + n], gu_s[s:s + n], dn_s[s:s + n]))

    want = quantized_reference(x, weights, ids, gate_up, down, kind, rounds)
    unquantized = dense_reference(x, weights, ids, gate_up, down)
    assert np.abs(want).max() > 0.5
    assert np.abs(want - unquantized).max() > 1e-3  # the rounding is visible at this scale
    got = run(0, 8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    np.testing.assert_allclose(run(0, 4) + run(4, 4), want, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_expert_parallel_layer_equals_one_device(kind, monkeypatch):
    """Quantized experts at tp 2: weights and their scales split by expert (fp8: W8A8;
    the grouped matmul at every row count)."""
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "0")
    kw = dict(num_experts=8, top_k=2, intermediate_size=48, hidden_size=32,
              renormalize=True, dtype=jnp.float32, method=linear_method(kind))
    one = SparseMoE(rngs=nnx.Rngs(0), **kw)
    mesh = make_mesh(2)
    split = SparseMoE(rngs=nnx.Rngs(0), mesh=mesh, **kw)
    one.small_tokens = split.small_tokens = 0
    graphdef, state = nnx.split(split)
    state = jax.device_put(nnx.to_pure_dict(state), param_shardings(state, mesh))
    assert state["gate_up_proj"].dtype == linear_method(kind).weight_dtype
    assert state["gate_up_proj_scale"].addressable_shards[0].data.shape == (4, 2, 48)
    assert state["down_proj_scale"].addressable_shards[0].data.shape == (4, 32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 32)), jnp.float32)
    residual = jnp.ones_like(x)
    want = np.asarray(one(x, residual))
    got = jax.jit(lambda s, x, r: nnx.merge(graphdef, s)(x, r))(state, x, residual)
    assert np.abs(want - 1).max() > 1e-3
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows,small_kernel", [(8, "loop"), (8, "pallas"), (40, "loop")])
def test_gpt_oss_biases_and_clamped_glu_match_transformers_experts(rows, small_kernel,
                                                                 monkeypatch):
    """GPT-OSS's router bias, per-expert biases and clamped activation against
    transformers' GptOssMLP: a small step by the loop, the same with the fused small-step
    kernels chosen (they compute neither, so the layer keeps the loop: no pallas_call),
    and a large step by the grouped matmul."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from tests.jaxprs import equations

    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", small_kernel)
    e, i, h = 8, 48, 32
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e,
                       num_experts_per_tok=2, swiglu_limit=0.8, swiglu_alpha=1.5)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        x = torch.randn(1, rows, h)
        want = hf(x)[0][0].numpy()
    moe = SparseMoE(num_experts=e, top_k=2, intermediate_size=i, hidden_size=h,
                    renormalize=True, dtype=jnp.float32, rngs=nnx.Rngs(0), biases=True,
                    glu=MoEArch.from_hf_config(cfg).glu)
    experts = {k: v.detach().numpy() for k, v in hf.experts.named_parameters()}
    moe.router[...] = hf.router.weight.detach().numpy()
    moe.router_bias[...] = hf.router.bias.detach().numpy()
    # gate/up columns interleave gate and up; the layer stacks them `[E, 2, I, H]`.
    moe.gate_up_proj[...] = experts["gate_up_proj"].reshape(e, h, i, 2).transpose(0, 3, 2, 1)
    moe.gate_up_proj_bias[...] = experts["gate_up_proj_bias"].reshape(e, i, 2).transpose(0, 2, 1)
    moe.down_proj[...] = experts["down_proj"].transpose(0, 2, 1)
    moe.down_proj_bias[...] = experts["down_proj_bias"]
    graphdef, state = nnx.split(moe)
    step = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, None))
    got = np.asarray(step(state, x[0].numpy()))
    clamped = np.abs(np.einsum("th,ehn->ten", x[0].numpy(), experts["gate_up_proj"])) > 0.8
    assert clamped.mean() > 0.2 and np.abs(want).max() > 0.5  # many gate/up values clamp
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    jaxpr = jax.make_jaxpr(step)(state, x[0].numpy())
    assert "pallas_call" not in {eqn.primitive.name for eqn in equations(jaxpr.jaxpr)}
