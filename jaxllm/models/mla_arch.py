"""`MLAArch`: the static shape of DeepSeek-V2/V3's multi-head latent attention, read once
from a Hugging Face config (the module itself: models/mla.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.errors import ParameterError


@dataclass(frozen=True)
class MLAArch:
    """Each token's K and V come from one latent of `kv_lora_rank` (RMSNormed) and one
    rotated key part of `rope_dim` shared by every head; a query head is `nope_dim`
    columns that meet the latent through the head's slice of `kv_b_proj` and `rope_dim`
    that meet the shared key; a head's value is `v_dim` columns of the latent's up
    projection."""

    q_lora_rank: int  # 0: one q_proj (DeepSeek-V2-Lite); else q_a_proj, its norm, q_b_proj
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    bias: bool  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj add biases
    interleaved: bool  # the rope rotates (2i, 2i + 1) pairs (DeepSeek's own layout)

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def cache_dim(self) -> int:
        """What a token keeps in the cache: the normed latent, then its rotated key part."""
        return self.kv_lora_rank + self.rope_dim

    @classmethod
    def from_hf_config(cls, cfg: Any, model_type: str) -> MLAArch:
        fields = {}
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(cfg, name, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParameterError(f"config.json:{name}", f"must be a positive integer, "
                                     f"got {value!r}")
            fields[name] = value
        if fields["qk_rope_head_dim"] % 2:
            raise ParameterError("config.json:qk_rope_head_dim",
                                 f"must be even (rope rotates pairs), got "
                                 f"{fields['qk_rope_head_dim']}")
        q_lora = getattr(cfg, "q_lora_rank", None)
        if q_lora is not None and (isinstance(q_lora, bool) or not isinstance(q_lora, int)
                                   or q_lora < 1):
            raise ParameterError("config.json:q_lora_rank", f"must be a positive integer or "
                                 f"null, got {q_lora!r}")
        # DeepSeek-V2 always rotates interleaved pairs; V3 unless `rope_interleave` is off.
        interleaved = (model_type == "deepseek_v2"
                       or getattr(cfg, "rope_interleave", None) is not False)
        return cls(q_lora_rank=q_lora or 0, kv_lora_rank=fields["kv_lora_rank"],
                   nope_dim=fields["qk_nope_head_dim"], rope_dim=fields["qk_rope_head_dim"],
                   v_dim=fields["v_head_dim"], bias=bool(getattr(cfg, "attention_bias", False)),
                   interleaved=interleaved)
