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
