"""The throughput roofline's FLOP count: the work a step must do, layer by layer."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from jaxllm.benchmarks.common import step_floor
from jaxllm.worker.model_runner import StepRecord

SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)
FAMILIES = {
    "llama-untied": lambda: (LlamaConfig(**SHAPE, tie_word_embeddings=False), LlamaForCausalLM),
    # Tied embeddings: the parameter count holds the [vocab, hidden] matrix once.
    "gemma2-tied": lambda: (Gemma2Config(**SHAPE, tie_word_embeddings=True), Gemma2ForCausalLM),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_step_floor_counts_the_last_layer_at_the_sampled_rows_only(family):
    cfg, model_cls = FAMILIES[family]()
    torch.manual_seed(0)
    model = model_cls(cfg)
    params = sum(p.numel() for p in model.parameters())
    sizes = {n: p.numel() for n, p in model.named_parameters()}

    def linear(layer: int, *names: str) -> int:
        return sum(sizes[f"model.layers.{layer}.{n}.weight"] for n in names)

    everything = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    # Two prompts of 40 and 24 tokens, whole: 64 tokens, 2 sampled rows.
    rec = StepRecord(num_tokens=64, padded_tokens=64, num_reqs=2, kv_tokens=64,
                     attn_pairs=40 * 41 // 2 + 24 * 25 // 2)
    last = cfg.num_hidden_layers - 1
    want = sum(2 * linear(i, *everything) * 64 for i in range(last))
    want += 2 * linear(last, "self_attn.k_proj", "self_attn.v_proj") * 64
    want += 2 * linear(last, "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                       "mlp.up_proj", "mlp.down_proj") * 2
    head_size = cfg.vocab_size * cfg.hidden_size  # lm_head, or the tied embedding
    want += 2 * head_size * 2
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # QK^T and PV: 4 FLOPs per (query, key) pair and head dimension, per head.
    want += 4 * cfg.num_attention_heads * head_dim * (last * rec.attn_pairs + rec.kv_tokens)
    # bandwidth out of the way: the FLOPs decide. The step_floor formula also counts
    # the RMSNorm weights as matmul parameters (under 0.5% of these models): hence approx.
    got = step_floor(rec, params, cfg, bw=1e30, peak=1.0)
    assert got == pytest.approx(want, rel=5e-3)
    # A decode step (one token per request) has nothing to skip.
    dec = StepRecord(num_tokens=2, padded_tokens=8, num_reqs=2, kv_tokens=66, attn_pairs=66)
    want_dec = sum(2 * linear(i, *everything) * 2 for i in range(cfg.num_hidden_layers))
    want_dec += 2 * head_size * 2
    want_dec += 4 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers * 66
    assert step_floor(dec, params, cfg, bw=1e30, peak=1.0) == pytest.approx(want_dec, rel=5e-3)


def _llama_3_8b():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained("configs/llama-3-8b")


def test_step_floor_at_tp1_is_the_single_device_formula_and_needs_no_link():
    from jaxllm.benchmarks.common import kv_bytes_per_token

    hf = _llama_3_8b()
    params = 8_030_261_248
    # decode-1's average step: one token reading 256 cached ones.
    rec = StepRecord(num_tokens=1, padded_tokens=1, num_reqs=1, kv_tokens=256, attn_pairs=256)
    want = (2 * params + 256 * kv_bytes_per_token(hf)) / 3.0e12
    assert step_floor(rec, params, hf, bw=3.0e12, peak=float("inf")) == want
    assert step_floor(rec, params, hf, bw=3.0e12, peak=float("inf"), tp=1,
                      link_bw=1.0) == want  # tp 1 has no all-reduce to time


def test_step_floor_at_tp2_adds_the_8b_all_reduces_by_hand():
    from jaxllm.benchmarks.common import allreduce_bytes_per_device

    hf = _llama_3_8b()
    params = 8_030_261_248
    # A decode step of 4 requests, each at 100 cached tokens.
    rec = StepRecord(num_tokens=4, padded_tokens=8, num_reqs=4, kv_tokens=400, attn_pairs=400)
    # 32 layers x 2 all-reduces of [4, 4096] bf16 = 32 KiB each; a ring over 2 devices
    # moves 2 * (2 - 1) / 2 = 1 of the buffer through each device.
    by_hand = 32 * 2 * (4 * 4096 * 2) * 1.0
    assert allreduce_bytes_per_device(rec, hf, tp=2) == by_hand == 2_097_152
    # A prefill step of one 64-token prompt: the last layer's all-reduces only at its row.
    pre = StepRecord(num_tokens=64, padded_tokens=64, num_reqs=1, kv_tokens=64,
                     attn_pairs=64 * 65 // 2)
    assert allreduce_bytes_per_device(pre, hf, tp=2) == (31 * 64 + 1) * 2 * 4096 * 2
    # tp 4: 2 * 3 / 4 of each buffer.
    assert allreduce_bytes_per_device(rec, hf, tp=4) == 32 * 2 * (4 * 4096 * 2) * 1.5

    bw, link = 3.0e12, 1.0e11
    # Each device reads half the weights and half the kv heads (8 kv heads over 2).
    kv_per_device = 2 * 32 * 4 * 128 * 2
    device_bytes = 2 * params / 2 + 400 * kv_per_device
    got = step_floor(rec, params, hf, bw=bw, peak=float("inf"), tp=2, link_bw=link)
    assert got == pytest.approx(device_bytes / bw + by_hand / link, rel=1e-12)
    # Compute-bound: the FLOPs split over both devices' peaks.
    one = step_floor(pre, params, hf, bw=1e30, peak=1e12)
    two = step_floor(pre, params, hf, bw=1e30, peak=1e12, tp=2, link_bw=1e30)
    assert two == pytest.approx(one / 2, rel=1e-12)
    with pytest.raises(ValueError, match="link_bw"):
        step_floor(rec, params, hf, bw=bw, peak=1e15, tp=2)


def test_step_floor_counts_replicated_kv_heads_per_device():
    from jaxllm.benchmarks.common import kv_bytes_per_device_token, kv_bytes_per_token

    hf = _llama_3_8b()  # 8 kv heads: at tp 16 each device holds one (replicated) head
    assert kv_bytes_per_device_token(hf, 2) == kv_bytes_per_token(hf) / 2
    assert kv_bytes_per_device_token(hf, 8) == kv_bytes_per_token(hf) / 8
    assert kv_bytes_per_device_token(hf, 16) == kv_bytes_per_token(hf) / 8


def test_allreduce_probe_measures_a_positive_bandwidth_on_two_cpu_devices():
    import jax

    from jaxllm.benchmarks.common import measure_allreduce_bandwidth

    devices = jax.devices()[:2]
    assert len(devices) == 2
    assert measure_allreduce_bandwidth(devices, gib=1 / 1024) > 0
    with pytest.raises(ValueError, match="devices"):
        measure_allreduce_bandwidth(devices[:1], gib=1 / 1024)


def test_step_floor_counts_only_the_routed_experts_of_a_tiny_qwen3_moe():
    """FLOPs: every token multiplies by its top_k experts and the router in each sparse
    layer, the dense layer's whole MLP; the last layer (sparse) only at the sampled rows.
    Bytes: each step reads the experts its tokens can hit, top_k at one token."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from jaxllm.benchmarks.moe_counts import expected_distinct_experts

    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=160,
                         moe_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                         mlp_only_layers=[1], tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    sizes = {n: p.numel() for n, p in model.named_parameters()}

    def weights(layer: int, *names: str) -> int:
        return sum(sizes[f"model.layers.{layer}.{n}"] for n in names)

    attn = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
    one_expert = 3 * 64 * 48
    routed = sizes["model.layers.0.mlp.gate.weight"] + 2 * one_expert  # router + top 2
    dense_mlp = weights(1, "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    assert weights(0, "mlp.experts.gate_up_proj", "mlp.experts.down_proj") == 8 * one_expert
    # Two prompts of 40 and 24 tokens: 64 tokens, 2 sampled rows.
    rec = StepRecord(num_tokens=64, padded_tokens=64, num_reqs=2, kv_tokens=64,
                     attn_pairs=40 * 41 // 2 + 24 * 25 // 2)
    want = 2 * (weights(0, *attn) + routed) * 64 + 2 * (weights(1, *attn) + dense_mlp) * 64
    want += 2 * weights(2, "self_attn.k_proj.weight", "self_attn.v_proj.weight") * 64
    want += 2 * (weights(2, "self_attn.q_proj.weight", "self_attn.o_proj.weight") + routed) * 2
    want += 2 * sizes["lm_head.weight"] * 2
    want += 4 * 4 * 16 * (2 * rec.attn_pairs + rec.kv_tokens)
    # step_floor counts the RMSNorm weights as matmul weights (the first test's approx).
    want += 2 * sum(n for name, n in sizes.items() if "norm" in name) * 64
    assert step_floor(rec, params, cfg, bw=1e30, peak=1.0) == pytest.approx(want, rel=1e-12)

    # Bytes: one decode token reads 2 of 8 experts in each of the 2 sparse layers.
    kv = 2 * 3 * 2 * 16 * 2
    dec = StepRecord(num_tokens=1, padded_tokens=8, num_reqs=1, kv_tokens=10, attn_pairs=10)
    no_experts = params - 2 * 8 * one_expert
    assert step_floor(dec, params, cfg, bw=1.0, peak=float("inf")) == pytest.approx(
        2 * (no_experts + 2 * 2 * one_expert) + 10 * kv, rel=1e-12)
    # 64 tokens: layer 0 the experts 64 tokens hit, layer 2 (rows only) those 2 rows hit.
    hit_64, hit_2 = expected_distinct_experts(8, 2, 64), expected_distinct_experts(8, 2, 2)
    assert hit_2 == pytest.approx(2 * 2 - 2 * 2 / 8) and 7.99 < hit_64 < 8
    assert step_floor(rec, params, cfg, bw=1.0, peak=float("inf")) == pytest.approx(
        2 * (no_experts + (hit_64 + hit_2) * one_expert) + 64 * kv, rel=1e-12)


def test_qwen3_30b_a3b_decode_reads_about_3b_parameters_at_batch_1_and_all_at_batch_256():
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from jaxllm.benchmarks.moe_counts import expert_counts

    hf = AutoConfig.from_pretrained("configs/qwen3-30b-a3b")
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3MoeForCausalLM(hf).parameters())
    assert 30.0e9 < params < 31.0e9
    counts = expert_counts(hf)
    assert (counts.num_experts, counts.top_k, counts.sparse_layers) == (128, 8, 48)
    active = params - counts.all_expert_params + counts.routed_params
    assert 3.0e9 < active < 3.6e9  # "A3B"; embeddings and lm_head included
    one = StepRecord(num_tokens=1, padded_tokens=1, num_reqs=1, kv_tokens=0, attn_pairs=0)
    assert step_floor(one, params, hf, bw=1.0, peak=float("inf")) == pytest.approx(2 * active)
    # 256 tokens of one prompt: its 47 full layers hit every expert but for a
    # (1 - 8/128)^256 chance each; the last layer runs its 1 sampled row (8 experts).
    big = StepRecord(num_tokens=256, padded_tokens=256, num_reqs=1, kv_tokens=0, attn_pairs=0)
    read = step_floor(big, params, hf, bw=1.0, peak=float("inf")) / 2
    per_layer = 128 * counts.params_per_expert
    assert read == pytest.approx(params - per_layer + 8 * counts.params_per_expert, rel=1e-6)
    # Split over 2 devices (expert parallel), each reads half.
    assert step_floor(one, params, hf, bw=1.0, peak=float("inf"), tp=2,
                      link_bw=float("inf")) == pytest.approx(active)


def test_weight_bytes_count_quantized_projections_at_one_byte_plus_their_scales(tmp_path):
    import dataclasses

    from flax import nnx

    from jaxllm.distributed.mesh import make_mesh
    from jaxllm.layers.attention import get_attention_backend
    from jaxllm.models.loader import load_model
    from jaxllm.worker.weight_stats import param_count, weight_bytes
    from tests.models.test_model_parity import model_config
    from tests.models.tiny_checkpoints import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")  # float32, untied
    mc = dataclasses.replace(model_config(model_dir), quantization="fp8")
    state = nnx.state(load_model(mc, make_mesh(1, hf_config=mc.hf_config),
                                 get_attention_backend("reference")))
    h, inter, layers, heads, kv, d, vocab = 64, 128, 2, 4, 2, 16, 256
    projections = layers * (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter)
    channels = layers * ((heads + 2 * kv) * d + h + 2 * inter + h)  # one scale per row
    floats = 2 * vocab * h + h + layers * 2 * h  # embeddings, lm_head and norms
    assert weight_bytes(state) == projections * 1 + channels * 4 + floats * 4
    assert param_count(state) == projections + channels + floats


def test_step_floor_reads_weights_as_held_and_runs_projections_at_the_linear_peak():
    hf = _llama_3_8b()
    params = 8_030_261_248
    embed = hf.vocab_size * hf.hidden_size
    # A decode step of 1 token at no context: bandwidth-bound; the weights' bytes count.
    dec = StepRecord(num_tokens=1, padded_tokens=1, num_reqs=1, kv_tokens=0, attn_pairs=0)
    bf16 = step_floor(dec, params, hf, bw=1e12, peak=float("inf"))
    assert bf16 == pytest.approx(2 * params / 1e12)
    fp8_bytes = (params - 2 * embed) * 1 + 2 * embed * 2
    assert step_floor(dec, params, hf, bw=1e12, peak=float("inf"),
                      weight_nbytes=fp8_bytes) == pytest.approx(fp8_bytes / 1e12)
    # A long prefill is compute-bound: with the projections at twice the peak, their
    # FLOPs take half the time while the LM head's and attention's do not change.
    pre = StepRecord(num_tokens=4096, padded_tokens=4096, num_reqs=1, kv_tokens=4096,
                     attn_pairs=4096 * 4097 // 2)
    same = step_floor(pre, params, hf, bw=float("inf"), peak=1e15)
    assert step_floor(pre, params, hf, bw=float("inf"), peak=1e15,
                      linear_peak=1e15) == pytest.approx(same, rel=1e-12)
    head_dim = hf.hidden_size // hf.num_attention_heads
    attn = 4 * hf.num_attention_heads * head_dim * (
        (hf.num_hidden_layers - 1) * pre.attn_pairs + pre.kv_tokens)
    head = 2 * embed * 1
    linear = same * 1e15 - attn - head
    fast = step_floor(pre, params, hf, bw=float("inf"), peak=1e15, linear_peak=2e15)
    assert fast == pytest.approx(linear / 2e15 + (attn + head) / 1e15, rel=1e-9)
    assert fast < 0.6 * same
