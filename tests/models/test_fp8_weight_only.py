"""FP8 weight-only products at small row counts, W8A8 above (layers/quant.py's `Fp8Linear`).

Weight-only is the dequantized model's math reassociated (e4m3 weights upcast
exactly, the per-channel scale applied after the float32 accumulation), so its
bounds are int8's: logits within 1e-4 of the float32 dequantized twin and every
greedy token equal. The choice is made per product from its static row count:
the step program of a small token bucket holds no activation quantization (no
convert to e4m3, no fp8 x fp8 dot), a large bucket's still does, and in a large
bucket the last layer's products that run on the request rows alone
(`forward_rows`) go weight-only again.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxllm.errors import ParameterError
from jaxllm.layers.quant import (
    FP8_MAX,
    FP8_WEIGHT_ONLY_TOKENS,
    WEIGHT_ONLY_ENV,
    Fp8Linear,
    dequantize,
    fp8_weight_only_tokens,
    linear_method,
    quantize_per_channel,
)
from jaxllm.worker.programs import step_functions
from jaxllm.worker.step_inputs import pack_step_inputs
from tests.models.quant_reference import dequantized_twin
from tests.models.test_model_parity import prompts_for, run_prefill_and_decode
from tests.models.test_quantization import (
    ARCHS,
    NEXT,
    assert_weights_are_the_twins,
    greedy_agreement,
    load,
)
from tests.models.tiny_checkpoints import make_tiny_checkpoint

F8 = "f8E4M3FN"


def _w8a8_reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Each row of `x` rounded to e4m3 at its own `amax / 448`, times the dequantized W."""
    s = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-12) / FP8_MAX
    xr = (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    return xr @ dequantize(q, scale).T


def test_fp8_product_is_weight_only_up_to_the_threshold_and_w8a8_above():
    rng = np.random.default_rng(0)
    w = (0.2 * rng.normal(size=(24, 32))).astype(np.float32)
    q, scale = quantize_per_channel(w, 1, "fp8")
    method = Fp8Linear(weight_only_tokens=8)
    for rows in (1, 8, 9, 16):
        x = rng.normal(size=(rows, 32)).astype(np.float32)
        got = np.asarray(method.product(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), 1))
        exact = x @ dequantize(q, scale).T
        if rows <= 8:
            np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5)
        else:
            np.testing.assert_allclose(got, _w8a8_reference(x, q, scale), rtol=0, atol=1e-5)
            assert np.abs(got - exact).max() > 1e-3  # the activations really are rounded


def test_weight_only_threshold_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(WEIGHT_ONLY_ENV, raising=False)
    assert fp8_weight_only_tokens() == FP8_WEIGHT_ONLY_TOKENS
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "128")
    assert linear_method("fp8").weight_only_tokens == 128
    assert linear_method("fp8_static") == Fp8Linear(static=True, weight_only_tokens=128)
    for bad in ("-1", "lots"):
        monkeypatch.setenv(WEIGHT_ONLY_ENV, bad)
        with pytest.raises(ParameterError, match=WEIGHT_ONLY_ENV):
            linear_method("fp8")


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_weight_only_fp8_logits_match_the_dequantized_float32_model(arch, tmp_path,
                                                                    monkeypatch):
    """Every product of the 24-token prefill and 8-token decode buckets is weight-only
    (the MoE's 48 token-expert rows too): int8's bound."""
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "64")
    model_dir = make_tiny_checkpoint(tmp_path, **ARCHS[arch])
    twin_dir = dequantized_twin(model_dir, "fp8", tmp_path)
    quantized, twin = load(model_dir, "fp8"), load(twin_dir)
    assert_weights_are_the_twins(quantized, twin)
    prompts = prompts_for(256)
    for g, w in zip(run_prefill_and_decode(quantized, prompts, NEXT),
                    run_prefill_and_decode(twin, prompts, NEXT), strict=True):
        assert np.abs(w).max() > 0.5
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)


def _step_program_text(model: nnx.Module, tokens: int, num_reqs: int = 4) -> str:
    """The engine's jitted forward (programs.step_functions) for a bucket of `tokens`,
    lowered to StableHLO text."""
    graphdef, state = nnx.split(model)
    width = 4
    forward = jax.jit(step_functions(graphdef, jax.tree.structure(state), model.head_logits,
                                     num_reqs, width)[4])  # the body, without out_bufs
    arch = model.arch
    backend = model.layers[0].self_attn.attn_backend
    cache = jax.ShapeDtypeStruct(backend.kv_cache_shape(arch.num_layers * 8, 8,
                                                        arch.num_kv_heads, arch.head_dim),
                                 jnp.float32)
    packed = pack_step_inputs(tokens, num_reqs, width)[0]
    return forward.lower(jax.tree.leaves(state), cache, packed,
                         np.zeros(num_reqs, np.int32)).as_text()


def _products(text: str) -> dict[str, int]:
    """Counts in a lowered program: activation converts to e4m3, dots of two e4m3
    operands (W8A8), and upcasts of e4m3 weights (weight-only)."""
    return {
        "to_fp8": len(re.findall(rf"stablehlo\.convert [^\n]*-> tensor<[^>]*x{F8}>", text)),
        "fp8_dots": len(re.findall(rf"stablehlo\.dot_general [^\n]*: \(tensor<[^>]*x{F8}>, "
                                   rf"tensor<[^>]*x{F8}>\)", text)),
        "upcasts": len(re.findall(rf"stablehlo\.convert [^\n]*: \(tensor<[^>]*x{F8}>\) -> "
                                  r"tensor<[^>]*x(?:f32|bf16)>", text)),
    }


def test_small_bucket_program_quantizes_no_activations_and_large_bucket_runs_w8a8(
        tmp_path, monkeypatch):
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "16")
    model = load(make_tiny_checkpoint(tmp_path, arch="llama"), "fp8")
    layers = model.arch.num_layers
    small = _products(_step_program_text(model, 16))
    assert small == {"to_fp8": 0, "fp8_dots": 0, "upcasts": 4 * layers}
    # 32 tokens over 4 request rows: the last layer runs qkv on every token (W8A8) and
    # o, gate_up and down on the 4 rows alone (weight-only).
    large = _products(_step_program_text(model, 32))
    assert large == {"to_fp8": 4 * layers - 3, "fp8_dots": 4 * layers - 3, "upcasts": 3}
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "0")
    always = _products(_step_program_text(load(make_tiny_checkpoint(tmp_path, arch="llama"),
                                               "fp8"), 16))
    assert always == {"to_fp8": 4 * layers, "fp8_dots": 4 * layers, "upcasts": 0}


@pytest.mark.slow
def test_weight_only_fp8_greedy_tokens_all_agree_with_the_dequantized_model(tmp_path,
                                                                            monkeypatch):
    """Buckets of 16 and 64 tokens, both weight-only: int8's floor of 1.0."""
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "64")
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    twin_dir = dequantized_twin(model_dir, "fp8", tmp_path)
    rate = greedy_agreement(model_dir, twin_dir, "fp8")
    print(f"greedy agreement fp8 weight-only: {rate:.4f}")
    assert rate == 1.0
