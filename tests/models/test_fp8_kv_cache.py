"""`kv_cache_dtype="fp8"`: an e4m3 KV cache with per-tensor K/V scales.

The cache holds K / k_scale and V / v_scale rounded to e4m3; the model applies
the scales around the attention body (models/decoder.py), so every body only
upcasts what it loads. A checkpoint's k_scale = 1/8, v_scale = 1/16 moves every
value onto another e4m3 grid (the logits must change) yet must stay within the
same bound of the float cache's logits as scale 1: a scale applied on one side
only (scores 8x or outputs 16x off) lands far outside it. The cache takes one
byte per element: twice the blocks of a float16 cache in the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxllm import LLM, SamplingParams
from jaxllm.distributed.mesh import make_mesh
from jaxllm.errors import ParameterError
from jaxllm.layers.attention import get_attention_backend
from jaxllm.models.loader import load_model
from tests.compilations import generate_recording_compilations
from tests.engine.hf_reference import random_prompts
from tests.models import test_model_parity as parity
from tests.models.tiny_checkpoints import make_tiny_checkpoint

NEXT = [7, 100, 255]


def load(model_dir: str, kv_cache_dtype: str = "auto") -> nnx.Module:
    mc = dataclasses.replace(parity.model_config(model_dir), kv_cache_dtype=kv_cache_dtype)
    return load_model(mc, make_mesh(1, hf_config=mc.hf_config),
                      get_attention_backend("reference"))


def logits_with_cache_dtype(model: nnx.Module, dtype) -> tuple[np.ndarray, np.ndarray]:
    original = parity._empty_cache
    parity._empty_cache = lambda m, sharding=None: original(m, sharding).astype(dtype)
    try:
        return parity.run_prefill_and_decode(model, parity.prompts_for(256), NEXT)
    finally:
        parity._empty_cache = original


def with_kv_scales(model_dir: str, k_scale: float, v_scale: float) -> str:
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    layers = json.load(open(os.path.join(model_dir, "config.json")))["num_hidden_layers"]
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(k_scale, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(v_scale, np.float32)
    save_file(tensors, os.path.join(model_dir, "model.safetensors"))
    return model_dir


def test_fp8_cache_logits_are_close_to_the_float_cache_and_scales_are_applied(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    want = parity.run_prefill_and_decode(load(model_dir), parity.prompts_for(256), NEXT)
    model = load(model_dir, "fp8")
    np.testing.assert_array_equal(np.asarray(model.kv_scales[...]), 1.0)  # vLLM's default
    unit = logits_with_cache_dtype(model, jnp.float8_e4m3fn)
    for g, w in zip(unit, want, strict=True):
        # K/V rounded to 3 mantissa bits (relative error <= 2^-4): logits move a little.
        assert np.abs(g - w).max() <= 0.1 * np.abs(w).max()
        assert not np.allclose(g, w, atol=1e-5)

    scaled_dir = with_kv_scales(model_dir, 1 / 8, 1 / 16)
    scaled = load(scaled_dir, "fp8")
    np.testing.assert_array_equal(np.asarray(scaled.kv_scales[...]),
                                  np.tile([1 / 8, 1 / 16], (2, 1)))
    got = logits_with_cache_dtype(scaled, jnp.float8_e4m3fn)
    for g, u, w in zip(got, unit, want, strict=True):
        assert np.abs(g - w).max() <= 0.1 * np.abs(w).max()
        assert not np.allclose(g, u, atol=1e-5)
    # The float cache ignores the scales: the checkpoint's scale tensors load quietly.
    np.testing.assert_allclose(parity.run_prefill_and_decode(
        load(scaled_dir), parity.prompts_for(256), NEXT)[0], want[0], rtol=0, atol=1e-6)


ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, token_buckets=[16], request_buckets=[4], seed=0,
              enable_prefix_caching=True, kv_cache_bytes=1 << 20)


@pytest.mark.slow
def test_every_attention_body_and_tp2_read_the_fp8_cache_alike_and_it_holds_twice_the_blocks(
        tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    prompts = random_prompts(256, [20, 9, 5], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend, tp in (("reference", 1), ("pallas_gpu", 1), ("pallas_tpu", 1),
                        ("reference", 2)):
        # One engine warmed up at start-up (nothing compiles while it serves); the
        # interpreted bodies compile on the first pass, and nothing on the second.
        warmed = (backend, tp) == ("reference", 1)
        llm = LLM(model_dir, kv_cache_dtype="fp8", attention_backend=backend,
                  attention_interpret=backend != "reference", tensor_parallel_size=tp,
                  precompile=warmed, **ENGINE)
        runner = llm.llm_engine.engine_core.engine_core.model_runner
        assert runner.kv_cache.dtype == jnp.float8_e4m3fn
        outs, compiles = generate_recording_compilations(llm, prompts, params)
        assert compiles[1] == [] and (compiles[0] == [] or not warmed)
        key = backend if tp == 1 else f"{backend}-tp{tp}"
        tokens[key] = [[list(o.outputs[0].token_ids) for o in run] for run in outs]
        assert tokens[key][0] == tokens[key][1]  # prefix-cache hits read it back
        if key == "reference":
            half = LLM(model_dir, **{**ENGINE, "dtype": "float16"})
            blocks16 = half.llm_engine.engine_core.engine_core.model_runner.num_kv_blocks
            assert runner.num_kv_blocks == 2 * blocks16  # the null block counted in both
            del half
        del llm
    assert tokens["pallas_gpu"] == tokens["reference"]
    assert tokens["pallas_tpu"] == tokens["reference"]
    assert tokens["reference-tp2"] == tokens["reference"]  # scales replicated, cache by head


def test_unknown_kv_cache_dtype_is_an_error_naming_the_field(tmp_path):
    from jaxllm.config import EngineArgs

    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    with pytest.raises(ParameterError, match="kv_cache_dtype"):
        EngineArgs(model=model_dir, kv_cache_dtype="int4").create_engine_config()


def test_a_converted_checkpoint_runs_an_fp8_cache_at_unit_scales(tmp_path):
    from jaxllm.entrypoints.cli_convert import convert

    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    out = str(tmp_path / "orbax")
    convert(model_dir, out)
    restored = load(out, "fp8")
    np.testing.assert_array_equal(np.asarray(restored.kv_scales[...]), 1.0)
    for g, w in zip(logits_with_cache_dtype(restored, jnp.float8_e4m3fn),
                    logits_with_cache_dtype(load(model_dir, "fp8"), jnp.float8_e4m3fn),
                    strict=True):
        np.testing.assert_array_equal(g, w)
