"""`jaxllm convert` writes an orbax checkpoint that restores the very weights the
safetensors path loads, each array in the mesh's sharding (models/orbax_io.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import EngineArgs
from jaxllm.distributed.mesh import make_mesh, param_shardings
from jaxllm.entrypoints import cli
from jaxllm.entrypoints.cli_convert import convert
from jaxllm.errors import ParameterError
from jaxllm.layers.attention import get_attention_backend
from jaxllm.models.loader import load_model
from jaxllm.models.orbax_io import METADATA_FILE, ORBAX_DIR
from tests.models.test_model_parity import model_config
from tests.models.tiny_checkpoints import make_tiny_checkpoint

# 4 q heads over 2 kv heads: at tp 4 each kv head is replicated (a different qkv layout).
TINY = dict(arch="llama", num_attention_heads=4, num_key_value_heads=2)


def _weights(model_dir: str, tp: int, load_format: str = "auto") -> tuple[dict, dict]:
    mc = model_config(model_dir, load_format=load_format)
    mesh = make_mesh(tp, hf_config=mc.hf_config)
    state = nnx.state(load_model(mc, mesh, get_attention_backend("reference")))
    return nnx.to_pure_dict(state), param_shardings(state, mesh)


@pytest.mark.parametrize("tp,arch", [(1, "llama"), (2, "llama"), (2, "qwen3_moe")])
def test_converted_checkpoint_restores_bit_identical_weights_in_the_mesh_shardings(
        tmp_path, tp, arch):
    """Qwen3-MoE: routed experts in layer 0, each device restoring its 2 of the 4."""
    moe = dict(mlp_only_layers=[1]) if arch == "qwen3_moe" else {}
    model_dir = make_tiny_checkpoint(tmp_path, **{**TINY, "arch": arch, **moe})
    out = str(tmp_path / "orbax")
    convert(model_dir, out, tensor_parallel_size=tp)
    assert os.path.isdir(os.path.join(out, ORBAX_DIR))
    assert not [n for n in os.listdir(out) if n.endswith(".safetensors")]
    with open(os.path.join(out, METADATA_FILE)) as f:
        assert json.load(f)["tensor_parallel_size"] == tp

    want, _ = _weights(model_dir, tp, load_format="safetensors")
    got, shardings = _weights(out, tp)  # load_format auto finds the orbax folder
    flat_want = dict(nnx.traversals.flatten_mapping(want))
    flat_got = dict(nnx.traversals.flatten_mapping(got))
    flat_sh = dict(nnx.traversals.flatten_mapping(shardings))
    assert flat_got.keys() == flat_want.keys() and len(flat_got) > 5
    for path, w in flat_want.items():
        g = flat_got[path]
        assert g.dtype == w.dtype and g.shape == w.shape, path
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
        assert g.sharding == flat_sh[path], path
    qkv = got["layers"][0]["self_attn"]["qkv_proj"]["weight"]
    assert len({s.device for s in qkv.addressable_shards}) == tp
    assert {s.data.shape[0] for s in qkv.addressable_shards} == {2 // tp}
    if moe:
        experts = got["layers"][0]["mlp"]["gate_up_proj"]
        assert {s.data.shape[0] for s in experts.addressable_shards} == {4 // tp}


def test_converted_dtype_is_what_auto_restores(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **TINY)
    out = str(tmp_path / "orbax")
    convert(model_dir, out, dtype="bfloat16")
    auto = EngineArgs(model=out, skip_tokenizer_init=True).create_engine_config()
    assert auto.model_config.dtype == "bfloat16"
    got, _ = _weights(out, 1)  # restored into float32 (model_config's dtype): a cast
    assert got["embed_tokens"].dtype == np.float32
    want, _ = _weights(model_dir, 1)
    emb_want = np.asarray(want["embed_tokens"]).astype(jax.numpy.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got["embed_tokens"]), emb_want)


def test_restoring_at_a_tensor_parallel_size_the_layout_does_not_fit_names_the_flag(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **TINY)
    out = str(tmp_path / "orbax")
    convert(model_dir, out, tensor_parallel_size=2)
    # tp 1 and 2 keep the 2 kv heads as they are; tp 4 replicates each (another qkv layout).
    _weights(out, 1)
    with pytest.raises(ParameterError, match="tensor_parallel_size.*converted for "
                                             "tensor_parallel_size=2.*tensor_parallel_size=4"):
        _weights(out, 4)


def test_load_format_orbax_without_the_folder_names_load_format(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **TINY)
    with pytest.raises(ParameterError, match="load_format.*jaxllm convert"):
        _weights(model_dir, 1, load_format="orbax")


def test_llm_on_a_converted_checkpoint_generates_what_the_safetensors_one_does(tmp_path):
    from jaxllm import LLM, SamplingParams

    model_dir = make_tiny_checkpoint(tmp_path, **TINY)
    out = str(tmp_path / "orbax")
    convert(model_dir, out, tensor_parallel_size=2)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["hello world", "abc"]
    kw = dict(tensor_parallel_size=2, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64, precompile=False, dtype="float32")
    texts = []
    for model in (model_dir, out):
        llm = LLM(model=model, **kw)
        texts.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert texts[0] == texts[1]
    assert all(len(t) == 8 for t in texts[1])


def test_cli_convert_writes_a_checkpoint_that_restores_the_same_weights(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **TINY)
    out = str(tmp_path / "orbax")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", "convert", model_dir,
                           out, "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tensor_parallel_size=2" in done.stdout
    want, _ = _weights(model_dir, 2)
    got, _ = _weights(out, 2)
    np.testing.assert_array_equal(np.asarray(got["lm_head"]), np.asarray(want["lm_head"]))



def test_cli_convert_into_an_existing_checkpoint_is_an_error_naming_out(tmp_path, capsys):
    model_dir = make_tiny_checkpoint(tmp_path, **TINY)
    out = str(tmp_path / "orbax")
    convert(model_dir, out)
    assert cli.main(["convert", model_dir, out]) == 2
    assert "error: out: " in capsys.readouterr().err


def test_a_config_that_no_longer_matches_the_checkpoint_names_the_weight(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **TINY)
    out = str(tmp_path / "orbax")
    convert(model_dir, out)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["intermediate_size"] *= 2
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ParameterError, match="model: orbax checkpoint .* weight "
                                             "'layers.0.mlp.down_proj.weight' has shape"):
        _weights(out, 1)
