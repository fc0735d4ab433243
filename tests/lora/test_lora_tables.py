"""The adapter tables of one loaded model: B holds each fused part's rows over that part's
own output columns only (no zero blocks), and every projection's term equals its
adapter merged into the weight in the model's fused layout, row by row by slot, at tp 1
and 2 (with kv heads replicated over the shards too)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoConfig

from jaxllm.config import ModelConfig
from jaxllm.distributed.mesh import make_mesh
from jaxllm.layers.attention import get_attention_backend
from jaxllm.lora.layers import LORA_PARTS, attach_lora, lora_linears, step_lora_masks
from jaxllm.lora.peft import PeftAdapter
from jaxllm.models.decoder_weights import hf_weight_map
from jaxllm.models.loader import load_model
from jaxllm.worker.lora_slots import adapter_tables
from tests.models.tiny_checkpoints import make_tiny_checkpoint

MAX_LORAS, RANK = 3, 4
# name -> (rank, modules): every module; a lower rank over a subset (parts left out);
# the rest.
ADAPTERS = {"all": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj")),
            "q_v_up": (3, ("q_proj", "v_proj", "up_proj")),
            "k_o_gate_down": (2, ("k_proj", "o_proj", "gate_proj", "down_proj"))}


def _load(tmp_path, tp: int, kv_heads: int):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama", num_attention_heads=4,
                                     num_key_value_heads=kv_heads)
    mc = ModelConfig(model=model_dir, tokenizer=model_dir, dtype="float32", max_model_len=64,
                     seed=0, skip_tokenizer_init=True, load_format="auto",
                     served_model_name=model_dir,
                     hf_config=AutoConfig.from_pretrained(model_dir))
    mesh = make_mesh(tp, hf_config=mc.hf_config)
    model = load_model(mc, mesh, get_attention_backend("reference"))
    attach_lora(model, mesh, MAX_LORAS, RANK)
    return model, mesh


def _hf_shapes(arch) -> dict[str, tuple[int, int]]:
    """Each PEFT module's `(out, in)` in the checkpoint."""
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * d, arch.num_kv_heads // arch.kv_replicas * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def _random_adapter(arch, rank: int, modules: tuple[str, ...], seed: int) -> PeftAdapter:
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(arch.num_layers):
        for module in modules:
            out, inp = _hf_shapes(arch)[module]
            weights[(layer, module)] = (rng.standard_normal((rank, inp)).astype(np.float32),
                                        rng.standard_normal((out, rank)).astype(np.float32))
    return PeftAdapter(rank, 1.0, weights)


def _merged_delta(arch, adapter: PeftAdapter, layer: int, proj: str) -> np.ndarray:
    """`B @ A` of each of the projection's modules (zeros where the adapter leaves one
    out), fused the way the loader fuses the checkpoint's weights: `[*out, *in]`."""
    deltas = []
    for module in LORA_PARTS[proj]:
        ab = adapter.weights.get((layer, module))
        deltas.append(np.zeros(_hf_shapes(arch)[module], np.float32) if ab is None
                      else ab[1] @ ab[0])
    where = "self_attn" if proj in ("qkv_proj", "o_proj") else "mlp"
    path = ("layers", layer, where, proj, "weight")
    source = next(s for s in hf_weight_map(arch) if s.path == path)
    return source.combine(deltas)


def test_fused_b_tables_hold_each_parts_rows_over_its_own_columns_only(tmp_path):
    model, _ = _load(tmp_path, tp=1, kv_heads=2)
    arch = model.arch
    kv, g, d = arch.num_kv_heads, arch.group, arch.head_dim
    inter, hidden = arch.intermediate_size, arch.hidden_size
    want = {"qkv_proj": (MAX_LORAS, RANK, g + 2, kv, d),  # q's G entries, then k, v
            "gate_up_proj": (MAX_LORAS, RANK, 2, inter),  # inter columns per part
            "o_proj": (MAX_LORAS, 1, RANK, hidden), "down_proj": (MAX_LORAS, 1, RANK, hidden)}
    linears = lora_linears(model)
    assert {proj for _, proj, _ in linears} == set(want)
    for _, proj, linear in linears:
        b = linear.lora.b[...]
        assert b.shape == want[proj], proj
        out_shape = linear.weight[...].shape[:-linear.in_dims]
        # One rank row per output column: no part's rows over another part's columns.
        assert b.size == MAX_LORAS * RANK * math.prod(out_shape), proj
        assert linear.lora.a[...].shape[:3] == (MAX_LORAS, len(LORA_PARTS[proj]), RANK)


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (2, 1)])
def test_each_projections_term_equals_its_merged_adapter_per_row_slot(tmp_path, tp,
                                                                      kv_heads):
    """Three random adapters (ranks 4, 3, 2; two leave parts out) in the three slots;
    requests with slots 2, none, 0, 1 and a padding row."""
    model, _ = _load(tmp_path, tp, kv_heads)
    arch = model.arch
    assert arch.kv_replicas == (2 if kv_heads == 1 and tp == 2 else 1)
    linears = lora_linears(model)
    adapters = [_random_adapter(arch, rank, modules, seed)
                for seed, (rank, modules) in enumerate(ADAPTERS.values())]
    for slot, (name, adapter) in enumerate(zip(ADAPTERS, adapters, strict=True)):
        values = adapter_tables(linears, adapter, name)
        for (_, _, linear), a, b in zip(linears, values[::2], values[1::2], strict=True):
            for table, value in ((linear.lora.a, a), (linear.lora.b, b)):
                old = table[...]
                table[...] = jax.device_put(old.at[slot].set(value), old.sharding)
    req_slots = np.array([2, -1, 0, 1], np.int32)
    cu_q_lens = np.array([0, 2, 3, 6, 7], np.int32)
    num_tokens = 8
    masks = step_lora_masks(jnp.asarray(req_slots), jnp.asarray(cu_q_lens),
                            num_tokens, MAX_LORAS)
    row_slot = np.append(np.repeat(req_slots, np.diff(cu_q_lens)), -1)
    rng = np.random.default_rng(7)
    for layer, proj, linear in linears:
        lora = linear.lora
        if tp > 1 and proj in ("qkv_proj", "gate_up_proj"):  # column-parallel outputs
            assert "model" in lora.b[...].sharding.spec, proj
        lora.masks = masks
        w = linear.weight[...]
        out_shape, in_shape = w.shape[:-linear.in_dims], w.shape[-linear.in_dims:]
        x = rng.standard_normal((num_tokens, *in_shape)).astype(np.float32)
        got = np.asarray(jax.jit(lambda x, lora=lora: lora(x))(x))
        want = np.zeros((num_tokens, *out_shape), np.float32)
        for row, slot in enumerate(row_slot):
            if slot >= 0:
                delta = _merged_delta(arch, adapters[slot], layer, proj)
                want[row] = np.tensordot(delta, x[row], axes=linear.in_dims)
        assert np.abs(want).max() > 1.0, (layer, proj)  # the adapters reach every projection
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{layer} {proj}")


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 1)])
def test_an_adapter_of_fused_modules_fills_the_tables_as_its_parts_would(tmp_path, tp,
                                                                        kv_heads):
    """Phi-3's PEFT adapters target `qkv_proj` and `gate_up_proj`: one A, B's rows
    stacked as the checkpoint stacks the weights (q, k, v; gate, up). Their tables are
    those of the same adapter written per part, kv heads replicated over shards too."""
    model, _ = _load(tmp_path, tp, kv_heads)
    arch = model.arch
    linears = lora_linears(model)
    parts = _random_adapter(arch, 4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj"), seed=3)
    rng = np.random.default_rng(5)
    fused = {}
    for layer in range(arch.num_layers):
        a = rng.standard_normal((4, arch.hidden_size)).astype(np.float32)
        for proj in ("qkv_proj", "gate_up_proj"):
            bs = []
            for module in LORA_PARTS[proj]:
                bs.append(parts.weights[(layer, module)][1])
                parts.weights[(layer, module)] = (a, bs[-1])  # the one A of its fused module
            fused[(layer, proj)] = (a, np.concatenate(bs, axis=0))
        fused[(layer, "o_proj")] = parts.weights[(layer, "o_proj")]
    got = adapter_tables(linears, PeftAdapter(4, 1.0, fused), "fused")
    want = adapter_tables(linears, parts, "parts")
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert any(np.abs(g).max() > 0 for g in got)
    both = {**fused, (0, "q_proj"): parts.weights[(0, "q_proj")]}
    with pytest.raises(ValueError, match="both qkv_proj and its parts"):
        adapter_tables(linears, PeftAdapter(4, 1.0, both), "both")
