"""FP8 checkpoints with static activation scales (vLLM's `activation_scheme: "static"`,
compressed-tensors' non-dynamic per-tensor input activations): each layer quantizes
its activations with the checkpoint's `input_scale` (the largest of a fused layer's
parts, as vLLM) instead of a dynamic per-token scale."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import EngineArgs
from jaxllm.errors import ParameterError
from jaxllm.layers.quant import (
    FP8_MAX,
    WEIGHT_ONLY_ENV,
    dequantize,
    linear_method,
    quantize_per_channel,
)
from jaxllm.models.quant_load import input_scale_path
from tests.models.quant_reference import static_input_scale, write_fp8_checkpoint
from tests.models.test_model_parity import prompts_for, run_prefill_and_decode
from tests.models.test_quantization import (
    ARCHS,
    FP8_MOE_CHECKPOINT_BOUND,
    NEXT,
    assert_weights_are_the_twins,
    load,
)
from tests.models.tiny_checkpoints import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def fp8_runs_w8a8_at_every_bucket(monkeypatch):
    """Static scales quantize activations: every product here runs W8A8."""
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "0")


def test_static_fp8_product_rounds_activations_at_the_layer_scale():
    """x / s rounded to e4m3 (saturating past 448), times s, against the dequantized
    weight; the dynamic per-token product differs."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 32)).astype(np.float32)
    x[2, 5] = 40.0  # past the static range 448 * s: saturates to it
    w = (0.2 * rng.normal(size=(16, 32))).astype(np.float32)
    q, scale = quantize_per_channel(w, 1, "fp8")
    s = np.float32(3.0 / FP8_MAX)
    static = linear_method("fp8_static")
    got = np.asarray(static.product(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), 1,
                                    jnp.asarray(s)))
    xs = np.clip(x / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    want = (xs.astype(np.float32) * s) @ dequantize(q, scale).T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    dynamic = np.asarray(linear_method("fp8").product(jnp.asarray(x), jnp.asarray(q),
                                                      jnp.asarray(scale), 1))
    assert np.abs(dynamic - got).max() > 1e-2


# The mean logit error over the mean |logit| (uncalibrated per-tensor scales are
# coarser than per-token ones for small activations; measured max error 0.11 of the
# largest logit); unrelated logits give ~1.
STATIC_BOUND = 0.1


def _input_scales(model: nnx.Module) -> dict[tuple, float]:
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    return {p: float(np.asarray(v.get_value())) for p, v in flat.items()
            if p[-1].endswith("input_scale")}


@pytest.mark.parametrize("layout", ["per_tensor", "per_channel"])
def test_static_activation_checkpoint_uses_the_largest_input_scale_of_each_layer(
        layout, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    static_dir, twin_dir, written = write_fp8_checkpoint(model_dir, layout, tmp_path,
                                                         static=True)
    dynamic_dir, _, _ = write_fp8_checkpoint(model_dir, layout, tmp_path)
    config = EngineArgs(model=static_dir).create_engine_config()
    assert config.model_config.quantization == "fp8_static"
    model, twin = load(static_dir, "fp8_static"), load(twin_dir)
    assert_weights_are_the_twins(model, twin)
    scales = _input_scales(model)
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
             "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    assert len(scales) == 4 * model.arch.num_layers
    for (_, i, block, proj, _), got in scales.items():
        want = max(static_input_scale(f"model.layers.{i}.{block}.{p}.weight")
                   for p in parts[proj])
        assert got == want
        assert written[f"model.layers.{i}.{block}.{parts[proj][0]}.input_scale"] > 0
    assert len(set(scales.values())) > 1
    prompts = prompts_for(256)
    got = run_prefill_and_decode(model, prompts, NEXT)
    dynamic = run_prefill_and_decode(load(dynamic_dir, "fp8"), prompts, NEXT)
    for g, w, d in zip(got, run_prefill_and_decode(twin, prompts, NEXT), dynamic,
                       strict=True):
        err = np.abs(g - w).mean() / np.abs(w).mean()
        print(f"static fp8 {layout}: mean logit error {err:.3f} of the mean |logit|, max "
              f"{np.abs(g - w).max() / np.abs(w).max():.3f} of the largest")
        assert err <= STATIC_BOUND
        assert not np.allclose(g, d, atol=1e-4)  # not the dynamic per-token scales


@pytest.mark.slow
def test_static_activation_moe_checkpoint_takes_the_largest_scale_over_experts(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **ARCHS["qwen3_moe"])
    fp8_dir, twin_dir, _ = write_fp8_checkpoint(model_dir, "per_tensor", tmp_path,
                                                static=True)
    model, twin = load(fp8_dir, "fp8_static"), load(twin_dir)
    assert_weights_are_the_twins(model, twin)
    scales = _input_scales(model)
    experts = range(8)
    for name, projs in (("gate_up_proj", ("gate_proj", "up_proj")),
                        ("down_proj", ("down_proj",))):
        want = max(static_input_scale(f"model.layers.0.mlp.experts.{e}.{p}.weight")
                   for e in experts for p in projs)
        assert scales[input_scale_path(("layers", 0, "mlp", name))] == want
    prompts = prompts_for(256)
    for g, w in zip(run_prefill_and_decode(model, prompts, NEXT),
                    run_prefill_and_decode(twin, prompts, NEXT), strict=True):
        assert np.abs(g - w).mean() / np.abs(w).mean() <= FP8_MOE_CHECKPOINT_BOUND


def test_quantization_flag_on_a_static_checkpoint(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    static_dir, _, _ = write_fp8_checkpoint(model_dir, "per_tensor", tmp_path, static=True)
    config = EngineArgs(model=static_dir, quantization="fp8").create_engine_config()
    assert config.model_config.quantization == "fp8_static"
    with pytest.raises(ParameterError, match="quantization"):
        EngineArgs(model=static_dir, quantization="int8").create_engine_config()
