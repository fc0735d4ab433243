"""`LoRARequest`: which adapter a request runs with, as vLLM spells it."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, frozen=True):  # type: ignore[call-arg]
    """An adapter by name, a positive integer id unique per adapter, and its PEFT
    directory (`adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
