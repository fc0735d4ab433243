"""Quantized models (int8 weight-only, FP8 W8A8) against their dequantized float32 twins.

The reference for a quantized model is the float32 model whose projection
weights are the dequantized quantized weights (tests/models/quant_reference.py),
so only the quantized arithmetic differs:
  * int8 weight-only: the same products with the per-channel scale applied after
    the float32 accumulation instead of before, a reassociation of exact float32
    math: logits agree to 1e-4 (the bound the transformers parity uses) and every
    greedy token agrees.
  * FP8 W8A8 (every product here: these tests pin the weight-only threshold to 0;
    tests/models/test_fp8_weight_only.py covers fp8's weight-only products):
    activations are also rounded to e4m3 per token (3 mantissa bits,
    relative rounding error up to 2^-4 per element), which the twin does not do:
    logits agree to 10% of their largest magnitude (errors of 2^-4 per element
    average out over the hidden size and do not compound much in two layers), and
    greedy tokens over 64 prompts x 32 tokens agree at a stated floor (the
    mixtures of experts, where the rounding can flip a token's expert choice and
    the experts' own activations are rounded too, get a looser stated bound).
The MoE families' experts are quantized too (one scale per expert and output
channel); their FP8 checkpoints carry a scale per expert projection.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.distributed.mesh import make_mesh
from jaxllm.errors import ParameterError
from jaxllm.layers import row_reduce
from jaxllm.layers.attention import get_attention_backend
from jaxllm.layers.quant import WEIGHT_ONLY_ENV, dequantize
from jaxllm.models.loader import load_model
from jaxllm.models.quant_load import scale_path
from tests.compilations import recorded_compilations
from tests.engine.hf_reference import random_prompts
from tests.models.quant_reference import dequantized_twin, write_fp8_checkpoint
from tests.models.test_model_parity import model_config, prompts_for, run_prefill_and_decode
from tests.models.tiny_checkpoints import make_tiny_checkpoint

NEXT = [7, 100, 255]
# Greedy agreement floors over 64 prompts x 32 tokens (a first disagreement
# changes the rest of that sequence, so the rate counts tokens up to it). int8
# weight-only is the twin's math reassociated: every token agrees. FP8 rounds
# every activation to e4m3 per token (relative error up to 2^-4), and on a random
# tiny model the top two logits are often closer than that noise, so sequences
# part early: 0.30 measured at tp 1 and 2 (CPU); the floor sits below it, far
# above what a wrong scale or layout gives (~0: unrelated tokens from the start).
# Reassociation still moves a logit by up to ~1e-5, so where the twin's own top two
# are closer than TIE a parting is a tie broken the other way, not a disagreement
# (int8 only: fp8's noise is far above it).
AGREEMENT_FLOOR = {"int8": 1.0, "fp8": 0.25}
TIE = 1e-4
# The MoE models (experts quantized too): int8 is exact math reassociated again;
# fp8's rounding can also flip an expert pick, so sequences part earlier.
MOE_AGREEMENT_FLOOR = {"int8": 1.0, "fp8": 0.15}


@pytest.fixture(autouse=True)
def fp8_runs_w8a8_at_every_bucket(monkeypatch):
    """fp8 models built here quantize their activations in every product."""
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "0")


def load(model_dir: str, quantization: str | None = None, tp: int = 1) -> nnx.Module:
    mc = dataclasses.replace(model_config(model_dir), quantization=quantization)
    return load_model(mc, make_mesh(tp, hf_config=mc.hf_config),
                      get_attention_backend("reference"))


def quantized_linears(model: nnx.Module) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """Path of each quantized weight (a Linear's, stacked experts') -> (weight, scale)
    as numpy."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    return {p: (np.asarray(v.get_value()), np.asarray(flat[scale_path(p)].get_value()))
            for p, v in flat.items() if not p[-1].endswith("scale") and scale_path(p) in flat}


def assert_weights_are_the_twins(quantized: nnx.Module, twin: nnx.Module) -> None:
    twin_flat = dict(nnx.to_flat_state(nnx.state(twin)))
    linears = quantized_linears(quantized)
    # Every Linear (qkv, o; gate_up, down of dense MLPs) and every MoE layer's stacked
    # experts are quantized; MoE routers are not.
    projections = [p for p in twin_flat if (p[-1] == "weight" and p[-2] in
                   ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
                   or p[-1] in ("gate_up_proj", "down_proj")]
    assert sorted(linears) == sorted(projections)
    for path, (q, scale) in linears.items():
        np.testing.assert_array_equal(dequantize(q, scale),
                                      np.asarray(twin_flat[path].get_value()))


def greedy_agreement(model_dir: str, twin_dir: str, quantization: str | None,
                     tp: int = 1, **sizes: Any) -> float:
    """Fraction of greedy tokens (64 prompts x 32) equal to the twin's, counted up to
    each sequence's first disagreement; asserts no compilation after warm-up. One bucket
    of 16 tokens and 16 requests (prompts prefilled in chunks beside decode steps)
    unless `sizes` says otherwise."""
    prompts = random_prompts(256, [int(n) for n in
                                   np.random.default_rng(5).integers(3, 17, size=64)], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    engine = {**dict(dtype="float32", max_model_len=64, max_num_seqs=16,
                     max_num_batched_tokens=16, token_buckets=[16], request_buckets=[16],
                     block_size=8, seed=0, tensor_parallel_size=tp), **sizes}
    outs = {}
    for name, d, q in (("quant", model_dir, quantization), ("twin", twin_dir, None)):
        # The quantized engine warmed up at start-up: nothing compiles while it serves.
        llm = LLM(d, quantization=q, precompile=name == "quant", **engine)
        with recorded_compilations() as compiles:
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert compiles == [] or name == "twin"
        outs[name] = [(list(r.outputs[0].token_ids), r.outputs[0].logprobs) for r in res]
    agreed = 0
    for (a, _), (b, twin_lps) in zip(outs["quant"], outs["twin"], strict=True):
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y),
                          len(a))
        if first_diff < len(a) and quantization == "int8":
            top = twin_lps[first_diff]
            gap = top[b[first_diff]].logprob - top[a[first_diff]].logprob \
                if a[first_diff] in top else float("inf")
            if gap < TIE:
                print(f"a tie broken the other way at token {first_diff} (gap {gap:.2e})")
                first_diff = len(a)
        agreed += first_diff
    return agreed / (64 * 32)


# Mixture-of-experts engines: decode steps (16 rows) take the small-step experts, whole
# prompts (a 64-row bucket) the grouped matmul.
MOE_SIZES = dict(max_num_batched_tokens=64, token_buckets=[16, 64])

ARCHS = {"llama": dict(arch="llama"),
         "gemma2": dict(arch="gemma2", sliding_window=4, tie_word_embeddings=True),
         # dense and sparse layers: attention, the dense MLP and the experts quantized
         "qwen3_moe": dict(arch="qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1],
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
         "mixtral": dict(arch="mixtral")}
# FP8 logits bound, as a fraction of the largest logit. The MoE models' expert picks
# can flip under the rounding, and their experts' activations are rounded too;
# measured (CPU): qwen3_moe 0.14, mixtral 0.28; dense models stay under 0.1.
FP8_LOGITS_BOUND = {"qwen3_moe": 0.2, "mixtral": 0.35}
# FP8 MoE checkpoints: the mean logit error over the mean |logit|, which a flipped
# expert pick at one position moves little (the largest error there reaches 0.46 of
# the largest logit); measured 0.05 to 0.09, unrelated logits give ~1.
FP8_MOE_CHECKPOINT_BOUND = 0.15


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_quantized_logits_are_close_to_the_dequantized_float32_model(kind, arch, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **ARCHS[arch])
    twin_dir = dequantized_twin(model_dir, kind, tmp_path)
    quantized, twin = load(model_dir, kind), load(twin_dir)
    assert_weights_are_the_twins(quantized, twin)
    prompts = prompts_for(256)
    got = run_prefill_and_decode(quantized, prompts, NEXT)
    want = run_prefill_and_decode(twin, prompts, NEXT)
    for g, w in zip(got, want, strict=True):
        assert np.abs(w).max() > 0.5
        if kind == "int8":
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)
        else:
            bound = FP8_LOGITS_BOUND.get(arch, 0.1)
            assert np.abs(g - w).max() <= bound * np.abs(w).max()
            assert not np.allclose(g, w, atol=1e-4)  # activations really are rounded


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp", [("int8", 1), ("fp8", 1), ("int8", 2), ("fp8", 2)])
def test_greedy_tokens_agree_with_the_dequantized_model_over_64_prompts(kind, tp, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    twin_dir = dequantized_twin(model_dir, kind, tmp_path)
    rate = greedy_agreement(model_dir, twin_dir, kind, tp)
    print(f"greedy agreement {kind} tp={tp}: {rate:.4f}")
    assert rate >= AGREEMENT_FLOOR[kind]


@pytest.mark.slow
@pytest.mark.parametrize("arch,kind,tp", [("mixtral", "int8", 1), ("mixtral", "fp8", 1),
                                          ("qwen3_moe", "int8", 2), ("qwen3_moe", "fp8", 2)])
def test_moe_greedy_tokens_agree_with_the_dequantized_model_over_64_prompts(arch, kind, tp,
                                                                           tmp_path):
    """Quantized experts (and attention) at tp 1, and expert parallel at tp 2."""
    model_dir = make_tiny_checkpoint(tmp_path, **ARCHS[arch])
    twin_dir = dequantized_twin(model_dir, kind, tmp_path)
    rate = greedy_agreement(model_dir, twin_dir, kind, tp, **MOE_SIZES)
    print(f"greedy agreement {arch} {kind} tp={tp}: {rate:.4f}")
    assert rate >= MOE_AGREEMENT_FLOOR[kind]


@pytest.mark.slow
@pytest.mark.parametrize("arch,kind", [("llama", "int8"), ("llama", "fp8"),
                                       ("qwen3_moe", "int8")])
def test_quantized_row_parallel_sums_under_shard_map_agree_with_the_dequantized_model(
        arch, kind, tmp_path, monkeypatch):
    """The peer all-reduce's route (layers/row_reduce.py, `psum` standing in for the
    kernel on CPU devices) takes the quantized output and down projections, each device
    applying its shard of the weight and its scales: tokens agree with the dequantized
    twin's as well as on XLA's route (fp8's activations are scaled per device's shard of
    the row, as vLLM's row-parallel layers scale them)."""
    monkeypatch.setenv(row_reduce.ENV, "psum")
    model_dir = make_tiny_checkpoint(tmp_path, **ARCHS[arch])
    twin_dir = dequantized_twin(model_dir, kind, tmp_path)
    rate = greedy_agreement(model_dir, twin_dir, kind, 2,
                            **(MOE_SIZES if arch == "qwen3_moe" else {}))
    floor = (MOE_AGREEMENT_FLOOR if arch == "qwen3_moe" else AGREEMENT_FLOOR)[kind]
    assert rate >= floor


@pytest.mark.parametrize("layout", ["per_tensor", "per_channel", "block"])
def test_fp8_checkpoint_loads_as_written_and_matches_its_dequantized_twin(layout, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    fp8_dir, twin_dir, written = write_fp8_checkpoint(model_dir, layout, tmp_path)
    model = load(fp8_dir, "fp8")
    twin = load(twin_dir)
    assert_weights_are_the_twins(model, twin)
    if layout != "block":  # the fp8 bits and scales are kept as written
        q, scale = quantized_linears(model)[("layers", 0, "mlp", "down_proj", "weight")]
        w_name = "model.layers.0.mlp.down_proj.weight"
        np.testing.assert_array_equal(q.view(np.uint8), written[w_name].view(np.uint8))
        np.testing.assert_array_equal(
            scale, np.broadcast_to(written[w_name + "_scale"].reshape(-1), scale.shape))
    prompts = prompts_for(256)
    got = run_prefill_and_decode(model, prompts, NEXT)
    want = run_prefill_and_decode(twin, prompts, NEXT)
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= 0.1 * np.abs(w).max()


@pytest.mark.parametrize("arch,layout", [("qwen3_moe", "per_tensor"),
                                         pytest.param("mixtral", "block",
                                                      marks=pytest.mark.slow)])
def test_fp8_moe_checkpoint_loads_per_expert_scales(arch, layout, tmp_path):
    """Each expert's projections carry their own scale (per tensor: kept bit for bit,
    one channel scale per expert; blocks: re-quantized per channel)."""
    model_dir = make_tiny_checkpoint(tmp_path, **ARCHS[arch])
    fp8_dir, twin_dir, written = write_fp8_checkpoint(model_dir, layout, tmp_path)
    model, twin = load(fp8_dir, "fp8"), load(twin_dir)
    assert_weights_are_the_twins(model, twin)
    if layout == "per_tensor":
        q, scale = quantized_linears(model)[("layers", 0, "mlp", "down_proj")]
        for e in (0, 3):
            w_name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
            np.testing.assert_array_equal(q[e].view(np.uint8), written[w_name].view(np.uint8))
            np.testing.assert_array_equal(scale[e], np.full(scale.shape[1:],
                                                            written[w_name + "_scale"]))
        assert scale[0, 0] != scale[3, 0]  # per expert, not one scale for all
    prompts = prompts_for(256)
    for g, w in zip(run_prefill_and_decode(model, prompts, NEXT),
                    run_prefill_and_decode(twin, prompts, NEXT), strict=True):
        err = np.abs(g - w).mean() / np.abs(w).mean()
        print(f"fp8 {arch} {layout} checkpoint logits: mean error {err:.3f} of the mean "
              f"|logit|, max {np.abs(g - w).max() / np.abs(w).max():.3f} of the largest")
        assert err <= FP8_MOE_CHECKPOINT_BOUND


def test_quantized_weights_shard_with_their_output_channels_at_tp2(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    one, two = load(model_dir, "fp8"), load(model_dir, "fp8", tp=2)
    attn = two.layers[0].self_attn
    assert attn.qkv_proj.weight_scale[...].sharding.spec[0] == "model"
    assert two.layers[0].mlp.gate_up_proj.weight_scale[...].sharding.spec[1] == "model"
    prompts = prompts_for(256)
    for g, w in zip(run_prefill_and_decode(two, prompts, NEXT),
                    run_prefill_and_decode(one, prompts, NEXT), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)


def test_unknown_quantization_is_an_error_naming_the_field(tmp_path):
    from jaxllm.config import EngineArgs

    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    with pytest.raises(ParameterError, match="quantization"):
        EngineArgs(model=model_dir, quantization="awq").create_engine_config()
    fp8_dir, _, _ = write_fp8_checkpoint(model_dir, "per_tensor", tmp_path)
    with pytest.raises(ParameterError, match="quantization"):
        EngineArgs(model=fp8_dir, quantization="int8").create_engine_config()
    config = EngineArgs(model=fp8_dir).create_engine_config()
    assert config.model_config.quantization == "fp8"


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_converted_quantized_checkpoint_restores_the_same_weights_and_quantization(
        kind, tmp_path):
    from jaxllm.config import EngineArgs
    from jaxllm.entrypoints.cli_convert import convert

    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    out = str(tmp_path / "orbax")
    convert(model_dir, out, quantization=kind)
    mc = EngineArgs(model=out, skip_tokenizer_init=True).create_engine_config().model_config
    assert mc.quantization == kind
    restored = load_model(mc, make_mesh(1, hf_config=mc.hf_config),
                          get_attention_backend("reference"))
    want = quantized_linears(load(model_dir, kind))
    got = quantized_linears(restored)
    assert set(got) == set(want)
    for path, (q, scale) in want.items():
        assert got[path][0].dtype == q.dtype
        np.testing.assert_array_equal(got[path][0].view(np.uint8), q.view(np.uint8))
        np.testing.assert_array_equal(got[path][1], scale)
