"""Each family's config reads into the generic decoder's per-layer settings as
transformers reads it; the classes and the loader agree on the KV cache's shape."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from jaxllm.errors import ParameterError
from jaxllm.models.loader import kv_cache_spec
from jaxllm.models.registry import get_model_class

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)


def test_gemma3_legacy_rope_fields_give_local_layers_their_base_and_global_layers_the_scaling():
    """`rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern` (the form of
    released Gemma 3 configs): every 3rd layer global with the scaled rope."""
    cfg = Gemma3TextConfig(**SHAPE, num_hidden_layers=6, rope_local_base_freq=100.0,
                           rope_theta=50000.0, rope_scaling={"rope_type": "linear",
                                                             "factor": 8.0},
                           sliding_window_pattern=3, sliding_window=16)
    arch = get_model_class("Gemma3ForCausalLM").arch_from_hf_config(cfg)
    hf = Gemma3RotaryEmbedding(cfg)
    assert arch.sliding_windows == (16, 16, None, 16, 16, None)
    for i, rope in enumerate(arch.ropes):
        kind = "full_attention" if i % 3 == 2 else "sliding_attention"
        want = getattr(hf, f"{kind}_inv_freq").numpy()
        np.testing.assert_allclose(np.asarray(rope.inv_freq), want, rtol=1e-6)
    assert arch.ropes[0] != arch.ropes[2]
    assert arch.qk_norm and arch.norm_offset and arch.embed_scale


def test_gemma2_alternates_sliding_and_global_layers_and_reads_its_caps_and_scale():
    cfg = Gemma2Config(**SHAPE, num_hidden_layers=4, sliding_window=32,
                       query_pre_attn_scalar=48)
    arch = get_model_class("Gemma2ForCausalLM").arch_from_hf_config(cfg)
    assert arch.sliding_windows == (32, None, 32, None)
    assert (arch.attn_soft_cap, arch.final_soft_cap) == (50.0, 30.0)
    assert arch.sm_scale == pytest.approx(48 ** -0.5)
    assert arch.activation == "gelu_tanh" and len(arch.norm_names) == 4
    assert not arch.qk_norm


def test_unsupported_gemma_activation_names_the_field():
    cfg = Gemma2Config(**SHAPE, num_hidden_layers=2, hidden_activation="relu")
    with pytest.raises(ParameterError, match="hidden_activation.*'relu'"):
        get_model_class("Gemma2ForCausalLM").arch_from_hf_config(cfg)


@pytest.mark.parametrize("arch,cfg", [
    ("LlamaForCausalLM", LlamaConfig(**SHAPE, num_hidden_layers=3)),
    ("Qwen3ForCausalLM", Qwen3Config(**SHAPE, num_hidden_layers=3)),
    ("Gemma2ForCausalLM", Gemma2Config(**SHAPE, num_hidden_layers=3)),
    ("Gemma3ForCausalLM", Gemma3TextConfig(**SHAPE, num_hidden_layers=3)),
])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_class_kv_cache_spec_equals_the_loaders(arch, cfg, tp):
    assert get_model_class(arch).kv_cache_spec(cfg, tp) == kv_cache_spec(cfg, tp)


@pytest.mark.parametrize("arch,cfg,extra", [
    ("LlamaForCausalLM", LlamaConfig(**SHAPE, num_hidden_layers=3), 4),
    ("Qwen3ForCausalLM", Qwen3Config(**SHAPE, num_hidden_layers=3), 5),  # + qk_norms
    ("Gemma2ForCausalLM", Gemma2Config(**SHAPE, num_hidden_layers=3), 3),  # tied
])
def test_a_layer_is_four_fused_weight_arrays_and_the_norms_are_stacked(arch, cfg, extra):
    """What the jitted step takes: per layer qkv, o, gate/up and down; besides them
    the embedding, the final norm, every layer's norms in one array (and q/k norms in
    one), and the lm_head unless tied."""
    from flax import nnx

    from jaxllm.layers.attention import get_attention_backend

    cls = get_model_class(arch)
    model = nnx.eval_shape(lambda: cls(cfg, dtype="float32", rngs=nnx.Rngs(0),
                                       attn_backend=get_attention_backend("reference")))
    leaves = jax.tree.leaves(nnx.state(model))
    assert len(leaves) == 4 * cfg.num_hidden_layers + extra
    assert model.layer_norms.shape == (3, len(model.arch.norm_names), 64)
    assert model.layers[0].self_attn.qkv_proj.weight.shape == (2, 4, 32, 64)
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (2, 96, 64)
