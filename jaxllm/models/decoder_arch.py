"""`DecoderArch`: the static shape and per-layer settings of a decoder family's model.

Each family reads its Hugging Face config into one `DecoderArch`
(models/llama.py, models/gemma.py); the generic decoder (models/decoder.py)
and its weight map (models/decoder_weights.py) read nothing else. Per-layer
attention settings (sliding window, rope) are tuples with one entry per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.layers.rotary import RotaryEmbedding
from jaxllm.models.mla_arch import MLAArch
from jaxllm.models.moe_weights import MoEArch

# Per-layer HF norm names: Llama's two, and Gemma's four (around attention and MLP).
PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")
# OLMo 2's two, on the attention's and MLP's outputs only (`post_norms`).
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
# Cohere's one, read by the attention and the MLP side by side (`parallel_block`).
PARALLEL_NORMS = ("input_layernorm",)


@dataclass(frozen=True)
class DecoderArch:
    """The static shape of a decoder model, read once from its HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # counts replicated copies (fewer kv heads than shards)
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    ropes: tuple[RotaryEmbedding, ...]  # per layer
    kv_replicas: int = 1  # copies of each checkpoint kv head (fewer kv heads than shards)
    mlp_kinds: tuple[str, ...] = ()  # per layer, a decoder_mlps.MLP_FACTORIES key; () = dense
    activation: str = "silu"  # the gated MLP's gate ("silu" or "gelu_tanh")
    norm_names: tuple[str, ...] = PRE_NORMS  # per layer; four: norms after attn/MLP too
    # OLMo 2: norms only on the attention's and the MLP's outputs (POST_NORMS), none on a
    # layer's input.
    post_norms: bool = False
    # OLMo 2: q and k each normed over all their heads at once (not per head as `qk_norm`).
    qk_norm_whole: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k (after their norms) and v clamped to +-this
    # Cohere: attention and MLP both read the layer's one norm (PARALLEL_NORMS) and add to
    # the residual together; its norms are LayerNorms (`layer_norm`), the final one too.
    parallel_block: bool = False
    # Ministral 3: (beta, length), each query times 1 + beta * log(1 + floor(position /
    # length)) after rope, so attention sharpens past the original context.
    q_position_scale: tuple[float, int] | None = None
    norm_offset: bool = False  # Gemma: RMSNorm scales by 1 + weight
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden), in the model dtype
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    query_pre_attn_scalar: float | None = None  # the attention scale is its -1/2 power
    logits_scale: float = 1.0  # the final logits times this (Granite)
    rope_interleaved: bool = False  # rotates (2i, 2i+1) pairs (decoder_weights.rope_order)
    # What the family's weight map folded into o_proj and down_proj (Granite's residual
    # multiplier); a LoRA adapter's terms on them take it too (worker/lora_slots.py).
    residual_scale: float = 1.0
    moe: MoEArch | None = None  # the routed experts of the "moe" layers (models/moe.py)
    attn_sinks: bool = False  # GPT-OSS: a learned sink logit per query head in each softmax
    # DeepSeek-V2/V3's multi-head latent attention (models/mla.py) in place of the fused
    # qkv attention; then `head_dim` is the cache's (the latent and the shared rope key).
    mla: MLAArch | None = None
    attn_scale: float | None = None  # the softmax scale where it is not a head width's
    # "int8" / "fp8" / "fp8_static": the attention, dense MLP and MoE experts' method
    # (layers/quant.py);
    # embeddings, the logits head and MoE routers stay in the model dtype.
    quantization: str | None = None

    def __post_init__(self):
        if not self.mlp_kinds:
            object.__setattr__(self, "mlp_kinds", ("dense",) * self.num_layers)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sandwich_norms(self) -> bool:
        """Norms on the attention's and the MLP's outputs before each residual add."""
        return len(self.norm_names) == 4

    @property
    def sm_scale(self) -> float:
        if self.attn_scale is not None:
            return self.attn_scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope_head_dim(self) -> int:
        """The width the rope rotates within: a head, or MLA's rope part of one."""
        return self.head_dim if self.mla is None else self.mla.rope_dim


def checked_model_type(cfg: Any, model_types: tuple[str, ...], family: str,
                       default: str | None = None) -> str:
    """The config's `model_type`, which must be one of the family's; else an error."""
    model_type = getattr(cfg, "model_type", default)
    if model_type not in model_types:
        raise ParameterError("model", f"model_type {model_type!r} is not a {family} model; "
                             f"supported: {', '.join(model_types)}")
    return model_type


def swiglu_model_type(cfg: Any, model_types: tuple[str, ...], family: str,
                      default: str | None = None) -> str:
    """The config's `model_type`, which must be one of the family's, and its `hidden_act`,
    which must be SiLU (the families whose MLPs are all SwiGLU); else an error naming the
    field."""
    model_type = checked_model_type(cfg, model_types, family, default)
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ParameterError("config.json:hidden_act", f"{act!r} is not supported; "
                             "supported: 'silu'")
    return model_type


def common_fields(cfg: Any, tensor_parallel_size: int) -> dict[str, Any]:
    """The fields every family reads the same way. `tensor_parallel_size`: with fewer
    kv heads than that, each kv head is replicated so that every shard holds one."""
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ParameterError("config.json:num_key_value_heads",
                             f"{kv_heads} does not divide num_attention_heads={heads}")
    replicas = max(1, tensor_parallel_size // kv_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    layer_types = layer_types_of(cfg)
    return dict(
        model_type=getattr(cfg, "model_type", "llama"),
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads * replicas,
        head_dim=head_dim,
        # A LayerNorm family (Cohere) sets its own `layer_norm_eps` over this.
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or cfg.layer_norm_eps),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        sliding_windows=sliding_windows(cfg, layer_types),
        ropes=layer_ropes(cfg, head_dim, layer_types),
        kv_replicas=replicas,
    )


def with_context(arch: DecoderArch, cfg: Any, max_model_len: int | None) -> DecoderArch:
    """`arch` with its ropes for an engine of `max_model_len` tokens (LongRoPE's factor
    set follows it); unchanged for None. A layer its family left without rope
    (EXAONE 4's global layers) stays so."""
    if max_model_len is None:
        return arch
    ropes = layer_ropes(cfg, arch.rope_head_dim, layer_types_of(cfg), max_model_len)
    return replace(arch, ropes=tuple(new if old.rotary_dim else old
                                     for old, new in zip(arch.ropes, ropes, strict=True)))


def rope_on_sliding_layers_only(arch: DecoderArch, layer_types: tuple[str, ...]
                                ) -> DecoderArch:
    """`arch` with its full-attention layers rotating nothing (EXAONE 4 and Cohere2's
    hybrid layouts: only the sliding-window layers take rope)."""
    nope = RotaryEmbedding(arch.head_dim, 0, ())
    return replace(arch, ropes=tuple(rope if t == "sliding_attention" else nope
                                     for rope, t in zip(arch.ropes, layer_types, strict=True)))


def layer_types_of(cfg: Any) -> tuple[str, ...] | None:
    """Each layer's attention type ("sliding_attention" / "full_attention"), or None
    where the config does not say (one window, or none, for every layer)."""
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return None
    n = int(cfg.num_hidden_layers)
    if len(layer_types) != n:
        raise ParameterError("config.json:layer_types",
                             f"has {len(layer_types)} entries for {n} layers")
    return tuple(layer_types)


def sliding_windows(cfg: Any, layer_types: tuple[str, ...] | None) -> tuple[int | None, ...]:
    window = getattr(cfg, "sliding_window", None)
    if layer_types is None:  # Mistral: one window for every layer (None: full attention)
        return (int(window) if window else None,) * int(cfg.num_hidden_layers)
    return tuple(int(window) if t == "sliding_attention" and window else None
                 for t in layer_types)


def layer_ropes(cfg: Any, head_dim: int, layer_types: tuple[str, ...] | None,
                max_model_len: int | None = None) -> tuple[RotaryEmbedding, ...]:
    """Each layer's rope; per layer type where the config nests its rope parameters
    by layer type (Gemma 3's local and global bases). `max_model_len`: the engine's
    context (`RotaryEmbedding.from_hf_config`)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())
    n = int(cfg.num_hidden_layers)
    if not nested or layer_types is None:
        ropes = (RotaryEmbedding.from_hf_config(cfg, head_dim, max_model_len=max_model_len),) * n
    else:
        by_type = {t: RotaryEmbedding.from_hf_config(cfg, head_dim, t, max_model_len)
                   for t in set(layer_types)}
        ropes = tuple(by_type[t] for t in layer_types)
    # SmolLM3: a 0 in `no_rope_layers` marks a layer that rotates nothing (NoPE).
    uses = getattr(cfg, "no_rope_layers", None)
    if uses is None:
        return ropes
    if len(uses) != n:
        raise ParameterError("config.json:no_rope_layers", f"has {len(uses)} entries for {n} "
                             "layers")
    return tuple(r if use else RotaryEmbedding(head_dim, 0, ())
                 for r, use in zip(ropes, uses, strict=True))
