"""Tiny random Hugging Face checkpoints (weights + char-level tokenizer) for tests.

`make_tiny_checkpoint(tmp_path, arch, **overrides)` writes a directory that both
transformers and jaxllm load: `config.json`, safetensors weights, a
`generation_config.json` and a fast tokenizer with bos/eos and a chat template.
Weights are drawn wider than transformers' default init (std 0.1, norms around
1) so logits spread out and greedy argmax ties are unlikely.
"""

from __future__ import annotations

import os
import string
import tempfile

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    ApertusConfig,
    ApertusForCausalLM,
    ArceeConfig,
    ArceeForCausalLM,
    Cohere2Config,
    Cohere2ForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    Glm4Config,
    Glm4ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    GraniteMoeSharedConfig,
    GraniteMoeSharedForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Ministral3Config,
    Ministral3ForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SeedOssConfig,
    SeedOssForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "ministral": (MinistralConfig, MinistralForCausalLM),
    "ministral3": (Ministral3Config, Ministral3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "granite": (GraniteConfig, GraniteForCausalLM),
    "granitemoe": (GraniteMoeConfig, GraniteMoeForCausalLM),
    "granitemoeshared": (GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM),
    "ernie4_5": (Ernie4_5Config, Ernie4_5ForCausalLM),
    "glm": (GlmConfig, GlmForCausalLM),
    "glm4": (Glm4Config, Glm4ForCausalLM),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
    "seed_oss": (SeedOssConfig, SeedOssForCausalLM),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM),
    "olmo3": (Olmo3Config, Olmo3ForCausalLM),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM),
    "exaone4": (Exaone4Config, Exaone4ForCausalLM),
    "cohere": (CohereConfig, CohereForCausalLM),
    "cohere2": (Cohere2Config, Cohere2ForCausalLM),
    "arcee": (ArceeConfig, ArceeForCausalLM),
    "apertus": (ApertusConfig, ApertusForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# Mixture-of-experts defaults: 4 experts, top 2 (Qwen3-MoE: experts half the dense MLP's
# width, top-k weights renormalized; Qwen2-MoE: a shared expert beside them).
ARCH_DEFAULTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    # Granite MoE: the experts of intermediate_size, Granite's multipliers off their
    # defaults (GraniteMoeShared: a shared expert beside them).
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=6.0,
                       residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=4.0),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=96, embedding_multiplier=6.0,
                             residual_multiplier=0.3, attention_multiplier=0.2,
                             logits_scaling=4.0),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96),
    # GLM-4.5: 8 experts in 4 groups, the best 2 groups kept, top 2; weights renormalized
    # then scaled; a shared expert; layer 0 dense; half of each head rotated; q/k norms.
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, partial_rotary_factor=0.5, use_qk_norm=True,
                     attention_bias=True),
    # DeepSeek: latent attention (a 32-wide kv latent, 8 rotated and 16 unrotated query
    # columns a head, 16-wide values), layer 0 dense, 8 experts, top 2, a shared expert.
    # V3: a q latent, grouped sigmoid routing (4 groups, the best 2), renormalized and
    # scaled. V2: no q latent (V2-Lite's q_proj), softmax routing, scaled. transformers
    # repeats the decompressed heads by heads // num_key_value_heads: equal, as released.
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4),
    "deepseek_v2": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
    # GPT-OSS: 8 experts, top 2 (of intermediate_size 128); a clamp low enough that
    # the tiny weights' gate and up values pass it, a gain that is not the default; yarn
    # (not truncated) past a 64-token original context; sliding then full layers.
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2,
                    swiglu_limit=1.0, swiglu_alpha=1.5, sliding_window=4,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=64)),
}
# Gemma's norms scale by 1 + weight: its random norm weights sit around 0.
_OFFSET_NORMS = ("gemma", "gemma2", "gemma3")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_tiny_checkpoint(tmp_path, arch: str = "llama", *, dtype: str = "float32",
                         seed: int = 0, init_std: float = 0.1,
                         max_shard_size: str | int | None = None, **overrides) -> str:
    """Saves a random `arch` model (hidden 64, 2 layers, vocab 256) and returns its directory.

    `arch`: a key of ARCHS; the mixture-of-experts ones add ARCH_DEFAULTS' fields.

    `overrides` are config fields (vocab_size, num_attention_heads,
    num_key_value_heads, head_dim, tie_word_embeddings, rope_scaling, ...);
    `dtype` is the on-disk dtype; `max_shard_size` splits the weights into
    several safetensors files with an index.
    """
    config_cls, model_cls = ARCHS[arch]
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=BOS_ID,
                  eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    fields.update(ARCH_DEFAULTS.get(arch, {}))
    fields.update(overrides)
    if not arch.startswith("deepseek"):  # its config sets head_dim to the rope part's
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if arch in _OFFSET_NORMS else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("self_attn.sinks"):  # as large as the tiny attention logits
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, init_std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a learned buffer, zeros at init
                b.normal_(0.0, 0.3)
    model = model.to(_TORCH_DTYPES[dtype])
    model.config.dtype = dtype
    out = tempfile.mkdtemp(prefix=f"{arch}-", dir=str(tmp_path))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    make_tiny_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def checkpoint_vocab_size(model_dir) -> int:
    """vocab_size from a checkpoint's config.json."""
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def make_tiny_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """Char-level tokenizer: ids 0-3 special, then printable ASCII, then filler tokens."""
    chars = list(" " + string.ascii_lowercase + string.ascii_uppercase + string.digits
                 + string.punctuation + "\n")
    tokens = (SPECIAL_TOKENS + chars)[:vocab_size]
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", chat_template=CHAT_TEMPLATE)


if __name__ == "__main__":  # handy for poking at a checkpoint by hand
    print(make_tiny_checkpoint(os.getcwd()))
