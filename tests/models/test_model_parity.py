"""Model logits equal transformers' (float32) over a ragged paged batch; loading is strict.

Each case writes a tiny random checkpoint with `save_pretrained`, loads it with
jaxllm, runs three prompts of different lengths as ONE ragged prefill through
the reference attention backend (block size 4, null block 0, padded tokens and
requests), then one decode token per request against the cache, and compares
every real row's logits with transformers run per prompt.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.lax import Precision
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from jaxllm.config import ModelConfig
from jaxllm.distributed.mesh import make_mesh
from jaxllm.errors import ParameterError
from jaxllm.layers.attention import AttentionMetadata, get_attention_backend
from jaxllm.models.loader import kv_cache_spec, load_model
from jaxllm.models.registry import get_model_class
from tests.jaxprs import equations
from tests.models.tiny_checkpoints import make_tiny_checkpoint

BLOCK_SIZE = 4
PROMPT_LENS = (5, 11, 3)
TOKEN_BUCKET, DECODE_BUCKET, REQUEST_BUCKET, TABLE_WIDTH = 24, 8, 4, 4

CASES = {
    "llama-gqa-untied": dict(arch="llama", num_key_value_heads=2),
    "llama-mha-tied": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": dict(arch="llama", rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16)),
    "llama-linear-rope-biases": dict(
        arch="llama", attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    "mistral-sliding-window": dict(arch="mistral", sliding_window=4),
    "qwen2-bias-tied": dict(arch="qwen2", tie_word_embeddings=True),
    # Ministral: a sliding layer then a full one.
    "ministral-layer-types": dict(arch="ministral", sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention"]),
    # Ministral 3: yarn over an original context of 4 tokens, so the query scale bites
    # from position 4 (1 + 0.5 log(1 + floor(p / 4))).
    "ministral3-yarn-query-scale": dict(arch="ministral3", rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        llama_4_scaling_beta=0.5)),
    "qwen3-qk-norm": dict(arch="qwen3", head_dim=32),
    # Interleaved rope pairs over the whole head, every projection biased.
    "ernie4_5-interleaved-rope-biases": dict(arch="ernie4_5", use_bias=True),
    # Interleaved pairs over half of each head, q/k/v biases, fused gate/up; GLM-4-0414
    # with norms after attention and MLP too.
    "glm-partial-interleaved-rope": dict(arch="glm", attention_bias=True,
                                         partial_rotary_factor=0.5),
    "glm4-sandwich-norms": dict(arch="glm4", attention_bias=True, partial_rotary_factor=0.5),
    # q/k/v biases and, named apart, the output projection's (and the MLP's).
    "seed-oss-biases": dict(arch="seed_oss", attention_bias=True, attention_out_bias=True,
                            mlp_bias=True),
    # Layer 1 of 2 rotates nothing (NoPE); GQA, untied.
    "smollm3-nope-layer": dict(arch="smollm3", no_rope_layer_interval=2),
    # Granite's four multipliers, tied (the embedding's folded into the logits head) and
    # untied with biases.
    "granite-multipliers-tied": dict(arch="granite", tie_word_embeddings=True,
                                     embedding_multiplier=12.0, residual_multiplier=0.22,
                                     attention_multiplier=0.015625, logits_scaling=8.0),
    "granite-multipliers-biases": dict(arch="granite", attention_bias=True, mlp_bias=True,
                                       embedding_multiplier=3.0, residual_multiplier=0.5,
                                       attention_multiplier=0.1, logits_scaling=0.5),
    # OLMo 2: norms on the attention's and MLP's outputs only, q and k each normed over
    # all heads at once; GQA, q/k/v/o biases.
    "olmo2-post-norms-whole-qk-norm": dict(arch="olmo2", attention_bias=True),
    # OLMo 3: a sliding layer then a full one, yarn on the full layers only.
    "olmo3-window-yarn-full-layers": dict(
        arch="olmo3", sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                original_max_position_embeddings=64)}),
    # EXAONE 4: OLMo 2's norm placement with per-head q/k norms; a sliding layer with rope
    # then a global one without (NoPE), tied.
    "exaone4-hybrid-nope-global": dict(arch="exaone4", sliding_window=4,
                                       sliding_window_pattern=2, tie_word_embeddings=True),
    # Without a window every layer global and rotated.
    "exaone4-global-rope": dict(arch="exaone4", sliding_window=None,
                                layer_types=["full_attention"] * 2),
    # Command R: attention and MLP side by side on one LayerNorm, interleaved rope, the
    # logit scale, tied; q/k/v/o biases.
    "cohere-parallel-block": dict(arch="cohere", logit_scale=0.5, attention_bias=True,
                                  tie_word_embeddings=True),
    # Command R7B: a sliding layer with rope, then a full one without.
    "cohere2-window-nope-full": dict(arch="cohere2", sliding_window=4, logit_scale=0.25,
                                     layer_types=["sliding_attention", "full_attention"],
                                     tie_word_embeddings=True),
    # Arcee AFM: a non-gated ReLU² MLP, biased, and llama3 rope scaling.
    "arcee-relu2-plain-mlp": dict(arch="arcee", mlp_bias=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16)),
    # Apertus: xIELU with learned scalars, per-head q/k norms, its own norm names.
    "apertus-xielu-qk-norm": dict(arch="apertus"),
    # OLMoE: q/k norms over every head, q/k/v clamped tight enough to bite, 8 experts
    # top 3 as they come out of the softmax.
    "olmoe-clip-qkv": dict(arch="olmoe", num_experts=8, num_experts_per_tok=3, clip_qkv=0.5),
    # Granite MoE: fused expert tensors, Granite's multipliers folded into the experts'
    # down projections too; tied, and untied with a shared expert.
    "granitemoe-multipliers-tied": dict(arch="granitemoe", tie_word_embeddings=True),
    "granitemoeshared-shared-expert": dict(arch="granitemoeshared", num_local_experts=8,
                                           num_experts_per_tok=3),
    # YaRN: frequencies ramped between interpolated and kept, cos and sin scaled.
    "qwen3-yarn-rope": dict(arch="qwen3", rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)),
    # Phi-3: fused qkv and gate/up tensors, a window, half of each head rotated by
    # LongRoPE's short factors (the engine's 256 tokens stay within the original 256)
    # with the attention factor of a 1024-token context.
    "phi3-longrope-short-partial-window": dict(
        arch="phi3", sliding_window=4, max_position_embeddings=1024,
        original_max_position_embeddings=256, partial_rotary_factor=0.5,
        rope_scaling=dict(type="longrope", short_factor=[1.0, 1.5, 2.0, 3.0],
                          long_factor=[4.0, 5.0, 6.0, 7.0])),
    "mixtral-4-experts-top2": dict(arch="mixtral"),
    # Layer 1 dense (mlp_only_layers), layers 0, 2 and 3 routed; top-k weights as they
    # come out of the softmax over all 8 experts.
    "qwen3-moe-dense-and-sparse-layers": dict(
        arch="qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1], num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False),
    # A gated shared expert beside the routed ones (softmax top-k, not renormalized);
    # layer 1 dense; q/k/v biases.
    "qwen2-moe-shared-expert": dict(arch="qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1],
                                    num_experts=8, num_experts_per_tok=2),
    # GLM-4.5 (tiny_checkpoints' defaults: grouped sigmoid routing with a correction bias,
    # a shared expert, layer 0 dense, partial rotary, q/k norms, q/k/v biases).
    "glm4-moe-grouped-routing": dict(arch="glm4_moe", num_hidden_layers=3),
    # DeepSeek (tiny_checkpoints' defaults: latent attention, layer 0 dense, a shared
    # expert): V3's q latent and grouped sigmoid routing, its rope not interleaved here;
    # V2's q_proj and greedy softmax routing, q/kv-a and o biases.
    "deepseek-v3-mla-rotate-half": dict(arch="deepseek_v3", num_hidden_layers=3,
                                        rope_interleave=False),
    "deepseek-v2-mla-biases": dict(arch="deepseek_v2", attention_bias=True),
    # GPT-OSS (tiny_checkpoints' defaults: attention sinks, a window shorter than the
    # prompts then a full layer, yarn, the router's and experts' biases, the clamp biting).
    "gpt-oss-sinks-window-biases": dict(arch="gpt_oss"),
    # Gemma (1): GeGLU, `1 + w` norms (two a layer), scaled embeddings, tied, MQA.
    "gemma-geglu-mqa-tied": dict(arch="gemma", num_key_value_heads=1, tie_word_embeddings=True),
    # Gemma 2: a sliding layer then a global one, both logit soft-caps low enough to
    # bite, an attention scale that is not head_dim's, tied embeddings.
    "gemma2-softcaps-tied": dict(arch="gemma2", sliding_window=4, attn_logit_softcapping=2.0,
                                 final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                                 tie_word_embeddings=True),
    # Gemma 3: q/k norms, local and global rope bases, rope scaling on the global
    # layers only, untied.
    "gemma3-local-global-rope": dict(
        arch="gemma3", sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                         "full_attention": dict(rope_type="linear", rope_theta=10000.0,
                                                factor=4.0)}),
}


def model_config(model_dir: str, dtype: str = "float32", load_format: str = "auto",
                 seed: int = 0) -> ModelConfig:
    return ModelConfig(model=model_dir, tokenizer=model_dir, dtype=dtype, max_model_len=256,
                       seed=seed, skip_tokenizer_init=True, load_format=load_format,
                       served_model_name=model_dir,
                       hf_config=AutoConfig.from_pretrained(model_dir))


def prompts_for(vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=n).astype(np.int32) for n in PROMPT_LENS]


def _metadata(q_lens: list[int], kv_lens: list[int], num_tokens: int) -> AttentionMetadata:
    """Request r owns blocks 1 + r*W ... ; padded tokens write to slot 0 (null block)."""
    slots = np.zeros(num_tokens, np.int32)
    tables = np.zeros((REQUEST_BUCKET, TABLE_WIDTH), np.int32)
    cu = np.zeros(REQUEST_BUCKET + 1, np.int32)
    lens = np.zeros(REQUEST_BUCKET, np.int32)
    t = 0
    for r, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        tables[r] = 1 + r * TABLE_WIDTH + np.arange(TABLE_WIDTH)
        pos = np.arange(kv - q, kv)
        slots[t:t + q] = tables[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        t += q
        cu[r + 1] = t
        lens[r] = kv
    cu[len(q_lens) + 1:] = t
    return AttentionMetadata(slot_mapping=jnp.asarray(slots), kv_lens=jnp.asarray(lens),
                             page_indices=jnp.asarray(tables), cu_q_lens=jnp.asarray(cu),
                             num_seqs=jnp.asarray([len(q_lens)], jnp.int32))


def _empty_cache(model: nnx.Module, sharding=None) -> jax.Array:
    """A zero KV cache for REQUEST_BUCKET requests of TABLE_WIDTH blocks (+ the null block)."""
    arch = model.arch
    shape = model.layers[0].self_attn.attn_backend.kv_cache_shape(
        arch.num_layers * (1 + REQUEST_BUCKET * TABLE_WIDTH), BLOCK_SIZE, arch.num_kv_heads,
        arch.head_dim)
    return jnp.zeros(shape, model.dtype, device=sharding)


def _prefill_inputs(prompts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, positions) of the prompts as one ragged prefill, padded to TOKEN_BUCKET."""
    lens = [len(p) for p in prompts]
    ids = np.zeros(TOKEN_BUCKET, np.int32)
    positions = np.zeros(TOKEN_BUCKET, np.int32)
    ids[:sum(lens)] = np.concatenate(prompts)
    positions[:sum(lens)] = np.concatenate([np.arange(n) for n in lens])
    return ids, positions


def run_prefill_and_decode(model: nnx.Module, prompts: list[np.ndarray],
                           next_tokens: list[int], kv_sharding=None) -> tuple[np.ndarray, ...]:
    """(prefill logits of the real rows [sum(L), V], decode logits [R, V]) as numpy."""
    caches = _empty_cache(model, kv_sharding)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, positions, caches, md):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(ids, positions, caches, md)
        return m.compute_logits(hidden), caches

    lens = [len(p) for p in prompts]
    logits, caches = step(state, *_prefill_inputs(prompts), caches,
                          _metadata(lens, lens, TOKEN_BUCKET))
    prefill = np.asarray(logits)[:sum(lens)]

    ids = np.zeros(DECODE_BUCKET, np.int32)
    positions = np.zeros(DECODE_BUCKET, np.int32)
    ids[:len(prompts)] = next_tokens
    positions[:len(prompts)] = lens
    md = _metadata([1] * len(prompts), [n + 1 for n in lens], DECODE_BUCKET)
    logits, _ = step(state, ids, positions, caches, md)
    return prefill, np.asarray(logits)[:len(prompts)]


def hf_logits(model_dir: str, prompts: list[np.ndarray], next_tokens: list[int], **kw):
    """`kw`: more of `from_pretrained`'s arguments."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    prefill, decode = [], []
    with torch.no_grad():
        for p, nxt in zip(prompts, next_tokens, strict=True):
            ids = torch.tensor(np.append(p, nxt)[None].astype(np.int64))
            out = hf(ids).logits[0].numpy()
            prefill.append(out[:-1])
            decode.append(out[-1])
    return np.concatenate(prefill), np.stack(decode)


def load(model_dir: str, tp: int = 1, **kw) -> nnx.Module:
    mc = model_config(model_dir, **kw)
    return load_model(mc, make_mesh(tp, hf_config=mc.hf_config), get_attention_backend("reference"))


@pytest.mark.parametrize("case", list(CASES))
def test_ragged_prefill_and_decode_logits_match_transformers(case, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, **CASES[case])
    prompts = prompts_for(256, seed=len(case))
    next_tokens = [7, 100, 255]
    got_prefill, got_decode = run_prefill_and_decode(load(model_dir), prompts, next_tokens)
    want_prefill, want_decode = hf_logits(model_dir, prompts, next_tokens)
    assert np.abs(want_prefill).max() > 0.5  # the comparison is not between near-zeros
    np.testing.assert_allclose(got_prefill, want_prefill, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_decode, want_decode, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral-4-experts-top2", "qwen3-moe-dense-and-sparse-layers",
                                  "qwen2-moe-shared-expert", "glm4-moe-grouped-routing",
                                  "olmoe-clip-qkv", "granitemoeshared-shared-expert",
                                  "gpt-oss-sinks-window-biases", "deepseek-v2-mla-biases"])
def test_moe_logits_by_the_megablox_kernel_match_transformers(case, tmp_path):
    """The routed experts by the Pallas TPU grouped matmul (interpret mode) at every step
    size, as on TPU."""
    from jaxllm.layers.grouped_matmul import GroupedMatmul
    from jaxllm.layers.moe import SparseMoE

    model_dir = make_tiny_checkpoint(tmp_path, **CASES[case])
    model = load(model_dir)
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moes and all(m.gmm.kernel == "ragged_dot" for m in moes)  # the CPU's default
    for m in moes:
        m.gmm, m.small_tokens = GroupedMatmul("megablox", interpret=True), 0
    prompts, next_tokens = prompts_for(256, seed=5), [9, 99, 199]
    got = run_prefill_and_decode(model, prompts, next_tokens)
    for g, w in zip(got, hf_logits(model_dir, prompts, next_tokens), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", ["llama-gqa-untied", "mistral-sliding-window",
                                  "qwen3-qk-norm", "gemma2-softcaps-tied",
                                  "gemma3-local-global-rope",
                                  pytest.param("qwen3-moe-dense-and-sparse-layers",
                                               marks=pytest.mark.slow)])
def test_forward_rows_equals_the_full_forward_at_the_last_rows(case, tmp_path):
    """`forward_rows` (the last layer for each request's last token only) gives the
    full forward's hidden states there and the same cache; `finish_states` gives the
    full forward's every row. The step mixes a decode and two prompt chunks over
    cached context, with a padding request and padding tokens."""
    model = load(make_tiny_checkpoint(tmp_path, **CASES[case]))
    arch = model.arch
    prompts = prompts_for(256)
    graphdef, state = nnx.split(model)
    lens = [len(p) for p in prompts]
    cache = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a)[1])(
        state, *_prefill_inputs(prompts), _empty_cache(model), _metadata(lens, lens, TOKEN_BUCKET))

    q_lens, extra = [1, 4, 2], np.random.default_rng(1).integers(4, 256, size=7)
    ids, positions = np.zeros(TOKEN_BUCKET, np.int32), np.zeros(TOKEN_BUCKET, np.int32)
    ids[:7] = extra
    positions[:7] = np.concatenate([np.arange(n, n + q) for n, q in zip(lens, q_lens, strict=True)])
    md = _metadata(q_lens, [n + q for n, q in zip(lens, q_lens, strict=True)], TOKEN_BUCKET)
    rows = jnp.maximum(md.cu_q_lens[1:] - 1, 0)

    @jax.jit
    def both(state, ids, positions, cache, md):
        m = nnx.merge(graphdef, state)
        full, full_cache = m(ids, positions, cache, md)
        got, got_cache, states = m.forward_rows(ids, positions, cache, md, rows)
        return full, full_cache, got, got_cache, m.finish_states(states, positions, got_cache, md)

    full, full_cache, got, got_cache, finished = both(state, ids, positions, cache, md)
    last = np.asarray(rows)[:len(q_lens)]
    assert got.shape == (REQUEST_BUCKET, arch.hidden_size)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(full_cache))
    np.testing.assert_allclose(np.asarray(got)[:len(q_lens)], np.asarray(full)[last],
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(finished)[:7], np.asarray(full)[:7], rtol=0,
                               atol=1e-5)
    assert np.abs(np.asarray(full)[last]).max() > 0.5  # not a comparison of near-zeros
    assert np.isfinite(np.asarray(got)).all()  # the padding request's row too


@pytest.mark.slow
def test_moe_layers_hear_the_steps_real_token_count(tmp_path, monkeypatch):
    """The decoder tells each MLP how many of its rows are real, so the experts route
    the padding nowhere: 7 tokens of the 24-token bucket in every sparse layer of a
    forward, and in `forward_rows`' last layer (one row per request) the 3 real
    requests of 4."""
    from jaxllm.layers.moe import SparseMoE

    heard, call = [], SparseMoE.__call__

    def spy(self, x, residual, num_tokens=None):
        jax.debug.callback(lambda n, rows=x.shape[0]: heard.append((rows, int(n))), num_tokens)
        return call(self, x, residual, num_tokens)

    monkeypatch.setattr(SparseMoE, "__call__", spy)
    model = load(make_tiny_checkpoint(tmp_path, **CASES["qwen3-moe-dense-and-sparse-layers"]))
    graphdef, state = nnx.split(model)
    ids, positions = np.zeros(TOKEN_BUCKET, np.int32), np.zeros(TOKEN_BUCKET, np.int32)
    ids[:7] = np.arange(4, 11)
    positions[:7] = [0, 0, 1, 2, 3, 0, 1]
    md = _metadata([1, 4, 2], [1, 4, 2], TOKEN_BUCKET)
    rows = jnp.maximum(md.cu_q_lens[1:] - 1, 0)
    jax.block_until_ready(jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(
        state, ids, positions, _empty_cache(model), md))
    assert sorted(heard) == [(TOKEN_BUCKET, 7)] * 3  # layer 1 is dense
    heard.clear()
    jax.block_until_ready(jax.jit(lambda s, *a: nnx.merge(graphdef, s).forward_rows(*a))(
        state, ids, positions, _empty_cache(model), md, rows))
    assert sorted(heard) == [(REQUEST_BUCKET, 3)] + [(TOKEN_BUCKET, 7)] * 2


def _params(model: nnx.Module) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def test_sharded_checkpoint_with_index_loads_the_same_weights(tmp_path):
    whole = make_tiny_checkpoint(tmp_path, seed=3)
    sharded = make_tiny_checkpoint(tmp_path, seed=3, max_shard_size="250KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) == 2
    jax.tree.map(np.testing.assert_array_equal, _params(load(whole)), _params(load(sharded)))


def test_bf16_checkpoint_loads_into_fused_layout_and_runs_in_either_dtype(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, dtype="bfloat16", num_key_value_heads=2)
    hf = load_file(os.path.join(model_dir, "model.safetensors"))
    prompts = prompts_for(256)
    want = hf_logits(model_dir, prompts, [1, 2, 3])  # bf16 weights, float32 compute
    for dtype, atol in (("float32", 1e-4), ("bfloat16", 0.1)):
        model = load(model_dir, dtype=dtype)
        qkv = model.layers[1].self_attn.qkv_proj.weight[...]
        assert qkv.dtype == jnp.dtype(dtype)
        # kv head 1 holds q heads 2 and 3, then k head 1, then v head 1 (head_dim 16).
        pre = "model.layers.1.self_attn."
        layout = torch.cat([hf[pre + "q_proj.weight"][32:64], hf[pre + "k_proj.weight"][16:32],
                            hf[pre + "v_proj.weight"][16:32]]).float().numpy().reshape(4, 16, 64)
        np.testing.assert_array_equal(np.asarray(qkv[1], np.float32), layout)
        got = run_prefill_and_decode(model, prompts, [1, 2, 3])
        for g, w in zip(got, want, strict=True):
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=0, atol=atol)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_float32_models_multiply_in_float32_and_bfloat16_ones_at_the_default(arch, tmp_path):
    """JAX's default float32 products are TF32 on NVIDIA GPUs and one bfloat16 pass on
    TPUs (layers/precision.py): every product of a float32 model's forward and logits,
    the experts' grouped ones too, is traced at HIGHEST; a bfloat16 model's at the
    default. (The CPU multiplies float32 fully either way, so only the program shows it.)"""
    model_dir = make_tiny_checkpoint(tmp_path, arch=arch)
    highest = (Precision.HIGHEST, Precision.HIGHEST)
    for dtype, want in (("float32", {highest}), ("bfloat16", {None})):
        products = _products(load(model_dir, dtype=dtype))
        names = {e.primitive.name for e in products}
        assert "dot_general" in names and ("ragged_dot_general" in names) == (arch == "qwen3_moe")
        assert {e.params["precision"] for e in products} == want, dtype


def _products(model: nnx.Module) -> list:
    """The matrix products of the model's traced prefill forward and logits."""
    graphdef, state = nnx.split(model)

    def step(state, ids, positions, caches, md):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(ids, positions, caches, md)
        return m.compute_logits(hidden), caches

    ids, positions = _prefill_inputs(prompts_for(256))
    jaxpr = jax.make_jaxpr(step)(state, ids, positions, _empty_cache(model),
                                 _metadata(list(PROMPT_LENS), list(PROMPT_LENS), TOKEN_BUCKET))
    return [e for e in equations(jaxpr.jaxpr)
            if e.primitive.name in ("dot_general", "ragged_dot_general")]


def test_missing_or_unexpected_tensor_is_named_in_the_error(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, path)
    with pytest.raises(ParameterError, match=f"missing tensor '{name}'"):
        load(model_dir)
    save_file({**tensors, "model.layers.9.extra.weight": torch.zeros(2)}, path)
    with pytest.raises(ParameterError, match="unexpected tensor 'model.layers.9.extra.weight'"):
        load(model_dir)


def test_dummy_weights_are_deterministic_from_the_seed(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path)
    a = _params(load(model_dir, load_format="dummy", seed=1))
    b = _params(load(model_dir, load_format="dummy", seed=1))
    c = _params(load(model_dir, load_format="dummy", seed=2))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert not np.array_equal(a["embed_tokens"], c["embed_tokens"])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(a))


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ParameterError, match="supported: ApertusForCausalLM, "
                                             "ArceeForCausalLM, "
                                             "BertForSequenceClassification, "
                                             "BertModel, Cohere2ForCausalLM, "
                                             "CohereForCausalLM, DeepseekV2ForCausalLM, "
                                             "DeepseekV3ForCausalLM, Ernie4_5ForCausalLM, "
                                             "Exaone4ForCausalLM, Gemma2ForCausalLM, "
                                             "Gemma3ForCausalLM, "
                                             "Gemma3ForConditionalGeneration, "
                                             "GemmaForCausalLM, Glm4ForCausalLM, "
                                             "Glm4MoeForCausalLM, GlmForCausalLM, "
                                             "GptOssForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_kv_cache_spec_reads_heads_and_head_dim_from_the_config(tmp_path):
    cfg = model_config(make_tiny_checkpoint(tmp_path, arch="qwen3", head_dim=32)).hf_config
    spec = kv_cache_spec(cfg)
    assert spec == (2, 2, 32)
    assert spec.bytes_per_token("bfloat16") == 2 * 2 * 2 * 32 * 2


@pytest.mark.parametrize("arch,expert_tensor", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.down_proj.weight")])
def test_moe_checkpoints_load_from_the_hubs_per_expert_tensor_names(arch, expert_tensor,
                                                                    tmp_path):
    """transformers keeps fused 3-D experts in memory but saves the hub's per-expert
    names, which real checkpoints use; those are the names the loader reads."""
    from jaxllm.models.loader import SafetensorsCheckpoint

    model_dir = make_tiny_checkpoint(tmp_path, arch=arch)
    names = SafetensorsCheckpoint(model_dir).names()
    assert expert_tensor in names and not any("gate_up_proj" in n for n in names)
    model = load(model_dir)
    down = load_file(os.path.join(model_dir, "model.safetensors"))[expert_tensor]
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.down_proj[...][3]),
                                  down.numpy())
