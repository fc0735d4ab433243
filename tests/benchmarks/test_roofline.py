"""The throughput roofline's FLOP count: the work a step must do, layer by layer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jaxllm.benchmarks.common import step_floor
from jaxllm.worker.model_runner import StepRecord


def test_step_floor_counts_the_last_layer_at_the_sampled_rows_only():
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
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
    want += 2 * sizes["lm_head.weight"] * 2
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # QK^T and PV: 4 FLOPs per (query, key) pair and head dimension, per head.
    want += 4 * cfg.num_attention_heads * head_dim * (last * rec.attn_pairs + rec.kv_tokens)
    # bandwidth out of the way: the FLOPs decide. The step_floor formula also counts
    # the RMSNorm weights as matmul parameters (0.2% of this model): hence approx.
    got = step_floor(rec, params, cfg, bw=1e30, peak=1.0)
    assert got == pytest.approx(want, rel=5e-3)
    # A decode step (one token per request) has nothing to skip.
    dec = StepRecord(num_tokens=2, padded_tokens=8, num_reqs=2, kv_tokens=66, attn_pairs=66)
    want_dec = sum(2 * linear(i, *everything) * 2 for i in range(cfg.num_hidden_layers))
    want_dec += 2 * sizes["lm_head.weight"] * 2
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


def test_weight_bytes_count_quantized_projections_at_one_byte_plus_their_scales(tmp_path):
    import dataclasses

    from flax import nnx

    from jaxllm.benchmarks.common import param_count, weight_bytes
    from jaxllm.distributed.mesh import make_mesh
    from jaxllm.layers.attention import get_attention_backend
    from jaxllm.models.loader import load_model
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
