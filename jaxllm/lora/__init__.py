"""Multi-LoRA: adapters applied per request inside one batch (vLLM's `--enable-lora`)."""

from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
