"""Greedy tokens, logprobs and prompt logprobs of the whole engine equal transformers'
(float32, CPU), for every supported family."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, hf_prompt_logprobs, random_prompts
from tests.models.tiny_checkpoints import make_tiny_checkpoint

NEW_TOKENS = 32
LENGTHS = [5, 13, 22, 31]
# One 16-token bucket: the prompts are prefilled in chunks beside other prompts' decode
# steps, through one compiled forward.
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, token_buckets=[16], request_buckets=[4], seed=0)

CASES = {
    "llama-gqa-untied": dict(arch="llama", num_key_value_heads=2, tie_word_embeddings=False),
    "llama-mha-tied": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "mistral": dict(arch="mistral", num_key_value_heads=2),
    # The query scale grows every 8 positions past an original context of 8.
    "ministral3-query-scale": dict(arch="ministral3", num_key_value_heads=2, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
        llama_4_scaling_beta=0.3)),
    "qwen2-bias-tied": dict(arch="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3-qknorm": dict(arch="qwen3", num_key_value_heads=2, tie_word_embeddings=False),
    "smollm3-nope-layer": dict(arch="smollm3", num_key_value_heads=2, no_rope_layer_interval=2),
    "glm4-interleaved-partial-rope": dict(arch="glm4", num_key_value_heads=2,
                                          attention_bias=True, partial_rotary_factor=0.5),
    "granite-multipliers": dict(arch="granite", num_key_value_heads=2, tie_word_embeddings=True,
                                embedding_multiplier=6.0, residual_multiplier=0.3,
                                attention_multiplier=0.2, logits_scaling=4.0),
    "exaone4-hybrid": dict(arch="exaone4", num_key_value_heads=2, num_hidden_layers=4,
                           sliding_window=8),
    "cohere-parallel-block": dict(arch="cohere", num_key_value_heads=2, logit_scale=0.5),
    "cohere2-windows-nope-full": dict(arch="cohere2", num_key_value_heads=2,
                                      num_hidden_layers=4, sliding_window=8, logit_scale=0.25),
    "arcee-relu2": dict(arch="arcee", num_key_value_heads=2),
    "apertus-xielu": dict(arch="apertus", num_key_value_heads=2),
    "olmo2-post-norms": dict(arch="olmo2", num_key_value_heads=2, attention_bias=True),
    # Three sliding layers of four (OLMo 3's default layout), windows shorter than the prompts.
    "olmo3-windows": dict(arch="olmo3", num_key_value_heads=2, num_hidden_layers=4,
                          sliding_window=8),
    "gemma-geglu-tied": dict(arch="gemma", num_key_value_heads=2, tie_word_embeddings=True),
    # Sliding windows shorter than the prompts; soft-caps low enough to change logits.
    "gemma2-softcaps": dict(arch="gemma2", num_key_value_heads=2, sliding_window=8,
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                            query_pre_attn_scalar=24, tie_word_embeddings=True),
    "gemma3-local-global": dict(
        arch="gemma3", num_key_value_heads=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                         "full_attention": dict(rope_type="linear", rope_theta=10000.0,
                                                factor=4.0)}),
    # Every prompt passes the original 4-token context, so transformers rotates by the
    # long factors throughout, as the engine does for its 128 tokens.
    "phi3-longrope-long-partial": dict(
        arch="phi3", num_key_value_heads=2, original_max_position_embeddings=4,
        partial_rotary_factor=0.5, rope_scaling=dict(
            type="longrope", short_factor=[1.0, 1.2, 1.4, 1.6], long_factor=[2.0, 3.0, 5.0, 8.0])),
    "mixtral": dict(arch="mixtral", num_key_value_heads=2),
    "qwen3-moe-dense-layer-1": dict(arch="qwen3_moe", num_key_value_heads=2, num_experts=8,
                                    mlp_only_layers=[1]),
    "qwen2-moe-shared-expert": dict(arch="qwen2_moe", num_key_value_heads=2, num_experts=8),
    "glm4-moe-grouped-routing": dict(arch="glm4_moe", num_key_value_heads=2),
    "olmoe-clip-qkv": dict(arch="olmoe", num_key_value_heads=2, num_experts=8, clip_qkv=0.5),
    "granitemoeshared": dict(arch="granitemoeshared", num_key_value_heads=2, num_local_experts=8),
    # DeepSeek's latent attention: V3 with a q latent and grouped sigmoid routing; V2 with
    # q_proj, softmax routing within the best 2 of 4 groups, and yarn whose mscale_all_dim
    # scales the softmax (a 16-token original context, so it rotates differently too).
    "deepseek-v3-mla-grouped": dict(arch="deepseek_v3"),
    "deepseek-v2-mla-yarn-group-limited": dict(
        arch="deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16, beta_fast=32.0,
                             beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)),
    # Attention sinks, a window of 8 shorter than the prompts, yarn, biased experts.
    "gpt-oss-sinks-window": dict(arch="gpt_oss", num_key_value_heads=2, sliding_window=8),
}

# The mixture-of-experts cases; the first seven also run through the fused expert kernel.
MOE_CASES = ("mixtral", "qwen3-moe-dense-layer-1", "qwen2-moe-shared-expert",
             "glm4-moe-grouped-routing", "olmoe-clip-qkv", "granitemoeshared",
             "deepseek-v3-mla-grouped", "deepseek-v2-mla-yarn-group-limited",
             "gpt-oss-sinks-window")

pytestmark = pytest.mark.slow  # an engine and transformers per model


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_top5_logprobs_and_prompt_logprobs_match_transformers(case, tmp_path,
                                                                           monkeypatch):
    overrides = dict(CASES[case])
    model_dir = make_tiny_checkpoint(tmp_path, **overrides)
    engine = ENGINE
    if case in MOE_CASES:  # decode steps take the small-step experts, prefill chunks the grouped
        monkeypatch.setenv("JAXLLM_MOE_SMALL_TOKENS", "8")
        engine = {**ENGINE, "token_buckets": [8, 16]}
    llm = LLM(model_dir, **engine)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(vocab, LENGTHS, seed=len(case))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref_tokens, ref_top = hf_greedy(model_dir, prompts, NEW_TOKENS)
    ref_prompt = hf_prompt_logprobs(model_dir, prompts)
    for out, want, want_top, want_prompt, prompt in zip(outs, ref_tokens, ref_top, ref_prompt,
                                                        prompts, strict=True):
        assert out.prompt_logprobs[0] is None
        got_prompt = [lp[t].logprob for t, lp in zip(prompt[1:], out.prompt_logprobs[1:],
                                                     strict=True)]
        assert max(abs(g - w) for g, w in zip(got_prompt, want_prompt, strict=True)) < 1e-4
        comp = out.outputs[0]
        assert comp.token_ids == want
        assert comp.finish_reason == "length"
        for got_lp, ref_lp in zip(comp.logprobs, want_top, strict=True):
            top5 = {t: lp.logprob for t, lp in got_lp.items() if lp.rank is not None
                    and lp.rank <= 5}
            assert set(top5) == set(ref_lp)
            for tok, lp in ref_lp.items():
                assert abs(top5[tok] - lp) < 1e-4


@pytest.mark.parametrize("case", MOE_CASES[:7])
def test_moe_decode_steps_through_the_fused_expert_kernel_match_transformers(
        case, tmp_path, monkeypatch):
    """The same parity with every small step's experts in pallas_kernels/moe_small (its
    Pallas interpret mode on the CPU) instead of the loop; GLM-4.5's grouped routing in
    jnp before them (DeepSeek-V3's too), the others' in the routing kernel."""
    monkeypatch.setenv("JAXLLM_MOE_SMALL_KERNEL", "pallas")
    test_greedy_tokens_top5_logprobs_and_prompt_logprobs_match_transformers(case, tmp_path,
                                                                           monkeypatch)
