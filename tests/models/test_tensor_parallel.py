"""Tensor parallelism over the fake CPU devices changes placement, never logits.

Model level: the forward on a mesh against the forward on one device (reference
body), including fewer kv heads than devices (kv heads replicated). The Pallas
bodies under tensor parallelism, chunked prefill, prefix hits, preemption,
compilations and collectives are tested on the whole engine in
tests/engine/test_tensor_parallel_engine.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.distributed.mesh import kv_cache_sharding, make_mesh, param_shardings
from jaxllm.errors import ParameterError
from jaxllm.layers.attention import get_attention_backend
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.loader import kv_cache_spec, load_model
from tests.models.test_model_parity import load, model_config, prompts_for, run_prefill_and_decode
from tests.models.tiny_checkpoints import make_tiny_checkpoint

CASES = {
    # GQA: 4 q heads over 2 kv heads; each of the 2 shards holds one kv head and its 2 q heads.
    "tp2-gqa": (2, dict(arch="llama", num_attention_heads=4, num_key_value_heads=2)),
    "tp2-qwen2-bias": (2, dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2)),
    "tp4-qwen3": (4, dict(arch="qwen3", num_attention_heads=8, num_key_value_heads=4,
                          head_dim=16)),
    # Fewer kv heads than devices: each of the 2 kv heads is replicated on 2 devices,
    # each device holding one copy and one of its 2 q heads.
    "tp4-gqa-replicated-kv": (4, dict(arch="llama", num_attention_heads=4,
                                      num_key_value_heads=2)),
    "tp8-mqa-replicated-kv": (8, dict(arch="qwen2", num_attention_heads=8,
                                      num_key_value_heads=1, head_dim=16)),
    # GLM-4's q/k rows permuted for its interleaved rope, then kv heads replicated.
    "tp4-glm4-replicated-kv": (4, dict(arch="glm4", num_attention_heads=4,
                                       num_key_value_heads=2, partial_rotary_factor=0.5)),
    # OLMo 2's q/k norms over every head, the mean summed across the shards, over
    # replicated kv heads; OLMo 3's windows and per-type ropes at tp 2.
    "tp4-olmo2-replicated-kv": (4, dict(arch="olmo2", num_attention_heads=4,
                                        num_key_value_heads=2, attention_bias=True)),
    "tp2-olmo3": (2, dict(arch="olmo3", num_attention_heads=4, num_key_value_heads=2,
                          sliding_window=4)),
    # EXAONE 4's post norms with per-head q/k norms, a window and NoPE global layers.
    "tp2-exaone4": (2, dict(arch="exaone4", num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=4, sliding_window_pattern=2)),
    # Cohere2's parallel block (both row-parallel sums), interleaved rope, NoPE full layers.
    "tp2-cohere2": (2, dict(arch="cohere2", num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=4, logit_scale=0.25)),
    # Arcee's non-gated MLP: up column parallel, down row parallel.
    "tp2-arcee": (2, dict(arch="arcee", num_attention_heads=4, num_key_value_heads=2)),
    "tp2-apertus": (2, dict(arch="apertus", num_attention_heads=4, num_key_value_heads=2)),
    # Phi-3's fused checkpoint tensors cut at the checkpoint's kv rows, then replicated.
    "tp4-phi3-replicated-kv": (4, dict(arch="phi3", num_attention_heads=4,
                                       num_key_value_heads=2)),
    # Expert parallel: each device holds 2 of the 4 experts (4 of 8 for Qwen3-MoE, whose
    # layer 1 is a dense, column/row-parallel MLP).
    "tp2-mixtral": (2, dict(arch="mixtral", num_attention_heads=4, num_key_value_heads=2)),
    # The routed experts expert parallel, the shared expert column/row parallel.
    "tp2-qwen2-moe-shared": (2, dict(arch="qwen2_moe", num_attention_heads=4,
                                     num_key_value_heads=2)),
    "tp2-glm4-moe-grouped": (2, dict(arch="glm4_moe", num_attention_heads=4,
                                     num_key_value_heads=2)),
    # Expert parallel, q/k/v/o biases, and the sinks split with their query heads (8 heads:
    # 4 a device, each with one of the 2 kv heads).
    "tp2-gpt-oss-sinks": (2, dict(arch="gpt_oss", num_attention_heads=8, num_key_value_heads=2,
                                  head_dim=16)),
    # OLMoE: the whole q/k norms and the clamp beside expert parallelism.
    "tp2-olmoe": (2, dict(arch="olmoe", num_attention_heads=4, num_key_value_heads=2,
                          clip_qkv=0.5)),
    # Granite MoE: the multipliers folded into the sharded experts and shared expert.
    "tp2-granitemoeshared": (2, dict(arch="granitemoeshared", num_attention_heads=4,
                                     num_key_value_heads=2)),
    "tp2-qwen3-moe": (2, dict(arch="qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
                              num_experts=8, mlp_only_layers=[1])),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if "moe" in c
                                  or "mixtral" in c or "gpt-oss" in c else c for c in CASES])
def test_tensor_parallel_logits_equal_single_device(case, tmp_path):
    tp, overrides = CASES[case]
    model_dir = make_tiny_checkpoint(tmp_path, **overrides)
    sharded = sharded_logits_match(model_dir, tp)
    kv_heads = overrides["num_key_value_heads"]
    qkv = sharded.layers[0].self_attn.qkv_proj.weight[...]
    assert qkv.sharding.spec == P("model", None, None, None)
    # Each device: max(1, kv_heads / tp) kv heads, with the q heads that read them.
    heads = overrides["num_attention_heads"]
    assert {s.data.shape[:2] for s in qkv.addressable_shards} == {
        (max(1, kv_heads // tp), heads // max(kv_heads, tp) + 2)}
    assert len({s.device for s in qkv.addressable_shards}) == tp
    for kind, layer in zip(sharded.arch.mlp_kinds, sharded.layers, strict=True):
        if kind == "moe":  # whole experts per device
            down = layer.mlp.down_proj[...]
            per_device = (down.shape[0] // tp, *down.shape[1:])
            assert {s.data.shape for s in down.addressable_shards} == {per_device}
        else:
            down = layer.mlp.down_proj.weight[...]
            assert down.addressable_shards[0].data.shape == (64, 128 // tp)


def sharded_logits_match(model_dir: str, tp: int) -> nnx.Module:
    """The model at `tp`, after checking its logits against one device's."""
    prompts, next_tokens = prompts_for(256, seed=1), [3, 50, 200]
    want = run_prefill_and_decode(load(model_dir, tp=1), prompts, next_tokens)
    sharded = load(model_dir, tp=tp)
    kv_sharding = kv_cache_sharding(sharded.embed_tokens.sharding.mesh,
                                    get_attention_backend("reference"))
    got = run_prefill_and_decode(sharded, prompts, next_tokens, kv_sharding=kv_sharding)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    return sharded


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_at_tp2_equals_single_device(arch, tmp_path):
    """DeepSeek's MLA: each device keeps a copy of the one latent kv head (40 wide: the
    32-wide latent and the 8-wide rope key) and half the query heads, with their slices of
    kv_b_proj and o_proj."""
    model_dir = make_tiny_checkpoint(tmp_path, arch=arch)
    sharded = sharded_logits_match(model_dir, 2)
    assert tuple(kv_cache_spec_of(model_dir, 2)) == (2, 2, 40)
    attn = sharded.layers[1].self_attn
    kv_b, o = attn.kv_b_proj[...], attn.o_proj.weight[...]
    assert {s.data.shape for s in kv_b.addressable_shards} == {(2, 32, 32)}
    assert {s.data.shape for s in o.addressable_shards} == {(64, 2, 16)}
    assert {s.data.shape for s in attn.kv_a_proj.weight[...].addressable_shards} == {(40, 64)}


def kv_cache_spec_of(model_dir: str, tp: int):
    from transformers import AutoConfig

    return kv_cache_spec(AutoConfig.from_pretrained(model_dir), tp)


def test_dummy_weights_do_not_depend_on_the_mesh(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path)
    one = nnx.to_pure_dict(nnx.state(load(model_dir, tp=1, load_format="dummy", seed=5)))
    two = nnx.to_pure_dict(nnx.state(load(model_dir, tp=2, load_format="dummy", seed=5)))
    assert two["layers"][0]["self_attn"]["qkv_proj"]["weight"].sharding.spec[0] == "model"
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 one, two)


def test_q_heads_not_divisible_by_tp_is_a_parameter_error_naming_the_flag(tmp_path):
    mc = model_config(make_tiny_checkpoint(tmp_path, num_attention_heads=6,
                                           num_key_value_heads=2, head_dim=16,
                                           hidden_size=96))
    with pytest.raises(ParameterError, match="tensor_parallel_size.*num_attention_heads=6 "
                                             "is not divisible by tensor_parallel_size=4"):
        make_mesh(4, hf_config=mc.hf_config)
    with pytest.raises(ParameterError, match="num_attention_heads=6"):
        load_model(mc, make_mesh(4), get_attention_backend("reference"))


def test_kv_heads_neither_dividing_nor_divided_by_tp_is_a_parameter_error(tmp_path):
    mc = model_config(make_tiny_checkpoint(tmp_path, num_attention_heads=6,
                                           num_key_value_heads=3, head_dim=16,
                                           hidden_size=96))
    with pytest.raises(ParameterError, match="num_key_value_heads=3 and "
                                             "tensor_parallel_size=2: neither divides"):
        make_mesh(2, hf_config=mc.hf_config)


def test_fewer_kv_heads_than_devices_replicates_them_in_the_cache_spec(tmp_path):
    cfg = model_config(make_tiny_checkpoint(tmp_path, num_attention_heads=8,
                                            num_key_value_heads=2, head_dim=8)).hf_config
    assert kv_cache_spec(cfg) == (2, 2, 8)
    assert kv_cache_spec(cfg, 2) == (2, 2, 8)
    assert kv_cache_spec(cfg, 8) == (2, 8, 8)  # 4 copies of each, one per device


def test_too_few_devices_is_a_parameter_error():
    with pytest.raises(ParameterError, match="needs 16 devices, but only 8"):
        make_mesh(16)


def test_vocab_not_divisible_by_tp_is_replicated_and_logits_still_match(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, vocab_size=251)
    state = nnx.state(nnx.eval_shape(lambda: LlamaForCausalLM(
        model_config(model_dir).hf_config, dtype="float32", rngs=nnx.Rngs(0),
        attn_backend=get_attention_backend("reference"))))
    shardings = param_shardings(state, make_mesh(2))
    assert shardings["embed_tokens"].spec == P(None, None)
    assert shardings["layers"][0]["mlp"]["gate_up_proj"]["weight"].spec == P(None, "model", None)
    prompts = prompts_for(251, seed=2)
    want = run_prefill_and_decode(load(model_dir, tp=1), prompts, [1, 2, 3])
    got = run_prefill_and_decode(load(model_dir, tp=2), prompts, [1, 2, 3])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
