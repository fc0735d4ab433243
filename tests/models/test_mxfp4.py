"""GPT-OSS's MXFP4 experts: the host dequantizer equals transformers', and a checkpoint whose
experts are packed loads to the weights and logits of its float twin, its
quantization_config accepted (and `--quantization int8` still applying on top)."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxllm.config import EngineArgs
from jaxllm.distributed.mesh import make_mesh
from jaxllm.errors import ParameterError
from jaxllm.layers.attention import get_attention_backend
from jaxllm.models.loader import load_model
from jaxllm.models.mxfp4 import dequantize
from tests.models.test_model_parity import hf_logits, load, prompts_for, run_prefill_and_decode
from tests.models.tiny_checkpoints import make_tiny_checkpoint

NEXT = [7, 100, 255]
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _packed(rng: np.random.Generator, shape: tuple[int, ...], low: int = 0, high: int = 255
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 (blocks, scales) for `[*shape, in]` values, `shape` ending in `in // 32`."""
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    scales = rng.integers(low, high, shape, dtype=np.uint8)
    return torch.from_numpy(blocks), torch.from_numpy(scales)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantized_values_equal_transformers_convert_moe_packed_tensors(dtype):
    """Every code and every finite scale byte (0..254: subnormal to overflowing values),
    bit for bit, in float32 and in bfloat16 (every value is exact in both)."""
    blocks, scales = _packed(np.random.default_rng(0), (3, 24, 4))
    want = convert_moe_packed_tensors(blocks, scales, dtype=getattr(torch, dtype))
    got = dequantize(blocks.numpy(), scales.numpy(),
                     np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
    want = want.transpose(1, 2).float().numpy()  # transformers' [E, in, out]
    assert got.shape == (3, 24, 128) and np.isinf(want).any() and (want == 0).any()
    np.testing.assert_array_equal(got.astype(np.float32), want)
    np.testing.assert_array_equal(np.signbit(got.astype(np.float32)), np.signbit(want))


def test_malformed_packed_tensors_are_a_parameter_error_naming_the_tensor():
    blocks, scales = _packed(np.random.default_rng(0), (2, 8, 2))
    with pytest.raises(ParameterError, match="experts.down_proj_blocks"):
        dequantize(blocks.numpy(), scales.numpy()[:, :, :1], name="experts.down_proj_blocks")


def write_mxfp4_twins(model_dir: str, tmp_path) -> tuple[str, str]:
    """(a copy of `model_dir` with its experts packed as MXFP4 blocks and scales, and
    quantization_config saying so; a float copy whose experts are those values)."""
    rng = np.random.default_rng(1)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    packed, floats = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = w.shape  # [in, out] as transformers holds them
            # Scales 2^-5 .. 2^-2: weights of the size the float checkpoint draws.
            blocks, scales = _packed(rng, (e, n_out, n_in // 32), 122, 126)
            del packed[name]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            floats[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    out = []
    for kind, ts in (("mxfp4", packed), ("float", floats)):
        d = str(tmp_path / kind)
        shutil.copytree(model_dir, d)
        save_file(ts, os.path.join(d, "model.safetensors"))
        if kind == "mxfp4":
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = QUANTIZATION_CONFIG
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
        out.append(d)
    return out[0], out[1]


def test_mxfp4_checkpoint_loads_the_weights_and_logits_of_its_float_twin(tmp_path):
    """The packed experts dequantize to exactly the float twin's weights; the logits equal
    transformers' on the packed checkpoint (its own dequantizing load); the engine takes
    the quantization_config as float weights, and `--quantization int8` on top."""
    packed_dir, float_dir = write_mxfp4_twins(make_tiny_checkpoint(tmp_path, arch="gpt_oss"),
                                              tmp_path)
    packed, twin = load(packed_dir), load(float_dir)
    assert packed.layers[0].mlp.gate_up_proj[...].shape == (8, 2, 128, 64)
    for a, b in zip(packed.layers, twin.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            np.testing.assert_array_equal(np.asarray(getattr(a.mlp, name)[...]),
                                          np.asarray(getattr(b.mlp, name)[...]))
    prompts = prompts_for(256, seed=2)
    want = hf_logits(packed_dir, prompts, NEXT,
                     quantization_config=Mxfp4Config(dequantize=True))
    for g, w in zip(run_prefill_and_decode(packed, prompts, NEXT), want, strict=True):
        assert np.abs(w).max() > 0.5
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)

    def model_config(**kw):
        return EngineArgs(model=packed_dir, skip_tokenizer_init=True,
                          **kw).create_engine_config().model_config

    assert model_config().quantization is None
    mc = model_config(quantization="int8")
    int8 = load_model(mc, make_mesh(1, hf_config=mc.hf_config),
                      get_attention_backend("reference"))
    experts = int8.layers[0].mlp
    assert experts.gate_up_proj[...].dtype == jnp.int8
    # The int8 experts stand for the dequantized float ones, to half a step each.
    scale = np.asarray(experts.gate_up_proj_scale[...])[..., None]
    error = np.abs(np.asarray(experts.gate_up_proj[...]) * scale
                   - np.asarray(twin.layers[0].mlp.gate_up_proj[...]))
    assert np.all(error <= 0.5 * scale + 1e-7)


def test_mxfp4_quantization_config_of_another_family_is_a_parameter_error(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="mixtral")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ParameterError, match="quantization_config.*GPT-OSS"):
        EngineArgs(model=model_dir).create_engine_config()
