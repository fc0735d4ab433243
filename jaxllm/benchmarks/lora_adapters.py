"""Random PEFT LoRA adapters on every projection of a decoder, for the LoRA benchmarks."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxllm.lora.request import LoRARequest

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(hf: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one layer of a Hugging Face decoder config."""
    h, heads = hf.hidden_size, hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    d = getattr(hf, "head_dim", None) or h // heads
    inter = hf.intermediate_size
    return {"q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h),
            "o_proj": (h, heads * d), "gate_proj": (inter, h), "up_proj": (inter, h),
            "down_proj": (h, inter)}


def write_random_adapters(hf: Any, num: int, rank: int, out_dir: str, seed: int = 0,
                          std: float = 0.01) -> list[LoRARequest]:
    """`num` adapters of rank `rank` (float16 on disk) under `out_dir`, as LoRARequests."""
    from safetensors.numpy import save_file

    shapes = projection_shapes(hf)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        path = os.path.join(out_dir, f"lora-{i}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(_PROJECTIONS), "bias": "none"}, f)
        tensors = {}
        for layer in range(hf.num_hidden_layers):
            for name, (o, n) in shapes.items():
                part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = (std * rng.standard_normal(
                    (rank, n), np.float32)).astype(np.float16)
                tensors[f"{key}.lora_B.weight"] = (std * rng.standard_normal(
                    (o, rank), np.float32)).astype(np.float16)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        out.append(LoRARequest(f"lora-{i}", i + 1, path))
    return out
