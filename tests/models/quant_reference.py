"""Quantized tiny checkpoints and their dequantized float32 twins, for the quantization tests.

`dequantized_twin` writes the float32 checkpoint whose projection weights are
exactly what jaxllm's load-time quantization stands for (`quantize_per_channel`
per Hugging Face tensor: a projection's output channels are its rows, and the
loader's fusions only stack rows, so per-row scales of each tensor are the fused
weight's per-channel scales). `write_fp8_checkpoint` rewrites a float
checkpoint in an FP8 format vLLM and transformers read: float8_e4m3fn weights
with a per-tensor `weight_scale` (`quant_method: "fp8"`, vLLM's Fp8Config), a
per-channel `[out, 1]` `weight_scale` (compressed-tensors, channel strategy,
dynamic per-token activations) or `[out/B, in/B]` `weight_scale_inv` blocks
(transformers' FineGrainedFP8, DeepSeek / Qwen FP8); each MoE expert's
projections get their own scales; embeddings, norms, MoE routers and the LM head
stay float, as those tools leave them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import zlib

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file as torch_save_file

from jaxllm.layers.quant import FP8_MAX, dequantize, quantize_per_channel

BLOCK = 24  # block scales' block size: not a divisor of the tiny shapes (partial blocks)
PROJECTION = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                        r"|(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj|w[123])"
                        r")\.weight$")


def _tensors(model_dir: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, name)))
    return out


def save_file(tensors: dict[str, np.ndarray], path: str) -> None:
    """safetensors through torch, which writes float8_e4m3fn as F8_E4M3."""
    def to_torch(a: np.ndarray) -> torch.Tensor:
        if a.dtype == ml_dtypes.float8_e4m3fn:
            return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.array(a))
    torch_save_file({k: to_torch(v) for k, v in tensors.items()}, path)


def _copy_dir(model_dir: str, tmp_path, prefix: str) -> str:
    out = tempfile.mkdtemp(prefix=prefix, dir=str(tmp_path))
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(model_dir, name), out)
    return out


def dequantized_twin(model_dir: str, kind: str, tmp_path) -> str:
    """The float32 checkpoint whose projections are `kind`-quantized-then-dequantized."""
    tensors = _tensors(model_dir)
    for name, w in tensors.items():
        if PROJECTION.search(name):
            tensors[name] = dequantize(*quantize_per_channel(w, 1, kind))
    out = _copy_dir(model_dir, tmp_path, f"deq-{kind}-")
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"))
    return out


def static_input_scale(name: str) -> np.float32:
    """A static activation scale for projection `name`: |x| up to 6 to 9 in range (the
    tiny models' activations stay under that), varying between tensors so that a fused
    layer's largest one is a real choice."""
    return np.float32(6.0 / FP8_MAX * (1 + (zlib.crc32(name.encode()) % 4) / 6))


def write_fp8_checkpoint(model_dir: str, layout: str, tmp_path, static: bool = False
                         ) -> tuple[str, str, dict[str, np.ndarray]]:
    """`(fp8 dir, dequantized float32 twin dir, the tensors written)` for `layout`
    "per_tensor" | "per_channel" | "block"; `static`: with a static per-tensor
    activation scale `X.input_scale` per projection (`activation_scheme: "static"`,
    compressed-tensors' non-dynamic tensor-strategy input activations)."""
    tensors = _tensors(model_dir)
    fp8: dict[str, np.ndarray] = {}
    twin: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        w = np.asarray(w, np.float32)
        if not PROJECTION.search(name):
            fp8[name] = twin[name] = w
            continue
        if layout == "per_tensor":
            scale = np.float32(np.abs(w).max() / FP8_MAX)
            q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
            fp8[name], fp8[name + "_scale"] = q, np.asarray(scale, np.float32).reshape(())
            deq = q.astype(np.float32) * scale
        elif layout == "per_channel":
            q, scale = quantize_per_channel(w, 1, "fp8")
            fp8[name], fp8[name + "_scale"] = q, scale.reshape(-1, 1)
            deq = dequantize(q, scale)
        else:  # BLOCK x BLOCK blocks, several per tiny weight, the last ones partial
            blocks = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
            padded = np.zeros((blocks[0] * BLOCK, blocks[1] * BLOCK), np.float32)
            padded[:w.shape[0], :w.shape[1]] = w
            amax = np.abs(padded.reshape(blocks[0], BLOCK, blocks[1], BLOCK)).max(axis=(1, 3))
            scale = (amax / FP8_MAX).astype(np.float32)
            spread = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:w.shape[0], :w.shape[1]]
            q = (w / spread).astype(ml_dtypes.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            # jaxllm re-quantizes block weights per output channel (layers/quant.py).
            deq = dequantize(*quantize_per_channel(q.astype(np.float32) * spread, 1, "fp8"))
        twin[name] = deq
        if static:
            fp8[name[:-len("weight")] + "input_scale"] = np.asarray(
                static_input_scale(name), np.float32).reshape(())
    qconfig = {
        "per_tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
        "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [BLOCK, BLOCK]},
        "per_channel": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                            "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "strategy": "token", "dynamic": True}}}},
    }[layout]
    if static and layout == "per_channel":
        qconfig["config_groups"]["group_0"]["input_activations"].update(strategy="tensor",
                                                                        dynamic=False)
    elif static:
        qconfig["activation_scheme"] = "static"
    fp8_dir = _copy_dir(model_dir, tmp_path, f"fp8-{layout}-")
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: np.ascontiguousarray(v) for k, v in fp8.items()},
              os.path.join(fp8_dir, "model.safetensors"))
    twin_dir = _copy_dir(model_dir, tmp_path, f"fp8-{layout}-twin-")
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in twin.items()},
              os.path.join(twin_dir, "model.safetensors"))
    return fp8_dir, twin_dir, fp8
