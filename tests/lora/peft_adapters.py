"""Tiny PEFT LoRA adapters on the tiny checkpoints, and transformers' greedy tokens with
an adapter merged (`merge_and_unload`): the oracle for multi-LoRA parity."""

from __future__ import annotations

import tempfile

import torch

from tests.engine.hf_reference import hf_greedy

# name -> PEFT LoraConfig fields: every projection, a subset with rsLoRA, the rest.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]),
    "qv_rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp_ko": dict(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]),
}


def make_peft_adapter(base_dir: str, out_root, seed: int = 0, std: float = 0.2,
                      **lora_fields) -> tuple[str, str]:
    """Saves a random LoRA adapter for `base_dir` (A and B both random: PEFT's B starts at
    zero) and the base model with it merged; returns (adapter dir, merged dir)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**lora_fields))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    adapter_dir = tempfile.mkdtemp(prefix="adapter-", dir=str(out_root))
    model.save_pretrained(adapter_dir)
    merged_dir = tempfile.mkdtemp(prefix="merged-", dir=str(out_root))
    model.merge_and_unload().save_pretrained(merged_dir)
    return adapter_dir, merged_dir


def merged_greedy(merged_dir: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return hf_greedy(merged_dir, prompts, new_tokens)[0]
