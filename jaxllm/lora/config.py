"""`LoRAConfig`: the engine's multi-LoRA settings (vLLM's --enable-lora flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.errors import ParameterError


@dataclass
class LoRAConfig:
    """Slots on the device and their rank."""

    max_loras: int = 1  # adapters resident at once, and distinct adapters per batch
    max_lora_rank: int = 16

    @classmethod
    def from_args(cls, args: Any, is_encoder: bool) -> LoRAConfig | None:
        """The checked settings of EngineArgs `args`; None when LoRA is off."""
        if not args.enable_lora:
            return None
        if args.max_loras < 1:
            raise ParameterError("max_loras", f"must be at least 1, got {args.max_loras}")
        if args.max_lora_rank < 1:
            raise ParameterError("max_lora_rank",
                                 f"must be at least 1, got {args.max_lora_rank}")
        if is_encoder:
            raise ParameterError("enable_lora", "LoRA serves decoder models only")
        return cls(args.max_loras, args.max_lora_rank)
