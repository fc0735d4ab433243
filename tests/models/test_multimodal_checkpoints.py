"""Multimodal Gemma 3 and Mistral 3 checkpoints load as their language model: the config
seam (models/multimodal.py), both tensor layouts, the strict loader, orbax conversion
and PEFT adapters. Outputs against transformers: tests/engine/test_multimodal_text_engine.py."""

from __future__ import annotations

import json
import os
import pickle

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from jaxllm.config import EngineArgs, ModelConfig, portable_config
from jaxllm.distributed.mesh import make_mesh
from jaxllm.entrypoints.cli_convert import convert
from jaxllm.errors import ParameterError
from jaxllm.layers.attention import get_attention_backend
from jaxllm.lora.peft import load_peft_adapter
from jaxllm.models.loader import kv_cache_spec, load_model
from tests.models.tiny_multimodal import (
    MODEL_CLASSES,
    make_tiny_multimodal_checkpoint,
    to_module_layout,
)

GEMMA3_TEXT = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def model_config(model_dir: str, load_format: str = "auto") -> ModelConfig:
    return EngineArgs(model=model_dir, dtype="float32", load_format=load_format,
                      skip_tokenizer_init=True)._model_config()


def weights(model_dir: str, load_format: str = "auto") -> dict:
    mc = model_config(model_dir, load_format)
    model = load_model(mc, make_mesh(1, hf_config=mc.hf_config),
                       get_attention_backend("reference"))
    return dict(nnx.traversals.flatten_mapping(
        jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))))


@pytest.mark.parametrize("family,tied,text_arch", [
    ("gemma3", True, "Gemma3ForCausalLM"), ("mistral3", False, "MistralForCausalLM"),
    ("mistral3", True, "MistralForCausalLM"), ("qwen2_vl", False, "Qwen2ForCausalLM"),
    ("qwen2_5_vl", False, "Qwen2ForCausalLM"),
    ("qwen3_vl", True, "Qwen3ForCausalLM")])
def test_multimodal_config_is_served_as_its_text_model_through_the_portable_copy(
        tmp_path, family, tied, text_arch):
    """The text config's context, the outer config's dtype and head tying (transformers'
    default ties Mistral 3's, whose head save_pretrained then leaves out), eos ids from
    generation_config.json; all of it as the engine core's process receives it."""
    text = GEMMA3_TEXT if family == "gemma3" else {}
    model_dir = make_tiny_multimodal_checkpoint(tmp_path, family, tie_word_embeddings=tied,
                                                max_position_embeddings=96, **text)
    gen_path = os.path.join(model_dir, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    with open(gen_path, "w") as f:
        json.dump({**gen, "eos_token_id": [2, 5]}, f)
    config = EngineArgs(model=model_dir, skip_tokenizer_init=True).create_engine_config()
    plain = pickle.loads(pickle.dumps(portable_config(config))).model_config
    for mc in (config.model_config, plain):
        assert mc.architecture == text_arch
        assert mc.checkpoint_architecture == MODEL_CLASSES[family].__name__
        assert (mc.dtype, mc.max_model_len, mc.eos_token_ids) == ("float32", 96, [2, 5])
        assert mc.vocab_size == 256 and bool(mc.hf_config.tie_word_embeddings) is tied
        assert kv_cache_spec(mc.hf_config) == (2, 2, 16)
    assert type(plain.hf_config).__name__ == "PlainHFConfig"
    for key, value in text.items():
        assert getattr(plain.hf_config, key) == value
    weights(model_dir)  # the head tying found the tensors the checkpoint holds


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_hub_and_module_tree_layouts_load_the_same_weights(tmp_path, family):
    hub = make_tiny_multimodal_checkpoint(tmp_path, family, **GEMMA3_TEXT)
    names = load_file(os.path.join(hub, "model.safetensors"))
    assert any(n.startswith("language_model.model.") for n in names)
    assert ("language_model.lm_head.weight" in names) is (family == "mistral3")
    want, got = weights(hub), weights(to_module_layout(hub, tmp_path))
    assert want.keys() == got.keys()
    assert (("lm_head",) in want) is (family == "mistral3")
    for path, w in want.items():
        np.testing.assert_array_equal(got[path], w)
    emb = names["language_model.model.embed_tokens.weight"].numpy()
    np.testing.assert_array_equal(want[("embed_tokens",)], emb)


@pytest.mark.parametrize("layout", ["hub", "module"])
def test_vision_tensors_are_skipped_but_an_unexpected_language_tensor_is_refused(
        tmp_path, layout):
    model_dir = make_tiny_multimodal_checkpoint(tmp_path, "mistral3")
    if layout == "module":
        model_dir = to_module_layout(model_dir, tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    prefix = "language_model.model." if layout == "hub" else "model.language_model."
    vision = "vision_tower." if layout == "hub" else "model.vision_tower."
    save_file({**tensors, vision + "extra.weight": torch.zeros(2)}, path)
    weights(model_dir)
    extra = prefix + "layers.9.extra.weight"
    save_file({**tensors, extra: torch.zeros(2)}, path)
    with pytest.raises(ParameterError, match=f"unexpected tensor '{extra}'"):
        weights(model_dir)
    save_file({**tensors, "audio_tower.proj.weight": torch.zeros(2)}, path)
    with pytest.raises(ParameterError, match="unexpected tensor 'audio_tower.proj.weight'"):
        weights(model_dir)


def test_a_text_model_type_the_wrapper_does_not_serve_is_named(tmp_path):
    model_dir = make_tiny_multimodal_checkpoint(tmp_path, "mistral3")
    cfg_path = os.path.join(model_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["text_config"]["model_type"] = "qwen2"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ParameterError, match=r"config.json:text_config.model_type: 'qwen2'"):
        model_config(model_dir)
    del cfg["text_config"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ParameterError, match="config.json:text_config: missing"):
        model_config(model_dir)


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_converted_multimodal_checkpoint_restores_the_text_models_weights(tmp_path, family):
    """The orbax copy holds no safetensors to read the head's tying from: its config says.
    Mistral 3's config as released leaves tie_word_embeddings out, which transformers
    reads as tied, while its checkpoint holds a head of its own."""
    model_dir = make_tiny_multimodal_checkpoint(tmp_path, family, **GEMMA3_TEXT)
    if family == "mistral3":
        cfg_path = os.path.join(model_dir, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        assert cfg.pop("tie_word_embeddings") is False
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    out = str(tmp_path / "orbax")
    convert(model_dir, out)
    want, got = weights(model_dir), weights(out)
    assert got.keys() == want.keys()
    for path, w in want.items():
        np.testing.assert_array_equal(got[path], w)


def test_peft_adapter_of_the_wrapper_loads_its_language_layers_and_skips_the_tower(tmp_path):
    """PEFT targets SigLIP's q_proj/v_proj too (`...vision_tower.encoder.layers.0.self_attn`),
    whose names would otherwise read as language layer 0's."""
    from peft import LoraConfig, get_peft_model

    model_dir = make_tiny_multimodal_checkpoint(tmp_path, "gemma3")
    base = MODEL_CLASSES["gemma3"].from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8,
                                                 target_modules=["q_proj", "v_proj", "fc1"]))
    adapter_dir = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter_dir)
    stored = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert any(".vision_tower.encoder.layers.0.self_attn.q_proj." in n for n in stored)
    adapter = load_peft_adapter(adapter_dir, max_lora_rank=8)
    assert set(adapter.weights) == {(i, m) for i in (0, 1) for m in ("q_proj", "v_proj")}
    at = "base_model.model.model.language_model.layers.0.self_attn.q_proj."
    a, b = adapter.weights[(0, "q_proj")]
    np.testing.assert_array_equal(a, stored[at + "lora_A.weight"].numpy())
    np.testing.assert_array_equal(b, stored[at + "lora_B.weight"].numpy() * 2.0)
