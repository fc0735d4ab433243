"""Quantized weights from a safetensors checkpoint: quantize at load, or read FP8 ones.

A quantized `Linear` (layers/quant.py) holds `weight` (int8 / float8_e4m3fn) and
a float32 per-output-channel `weight_scale` beside it (stacked MoE experts: `X`
and `X_scale`, one scale per expert and output channel, `scale_path`). Its weight source
(models/decoder_weights.py) names the checkpoint's float tensors; here
  * a float checkpoint's tensors are fused as usual, then quantized per output
    channel on the host (`--quantization fp8|int8` on a bf16 model); and
  * an FP8 checkpoint (config.json `quantization_config`) stores each
    projection as float8_e4m3fn `X.weight` plus a dequantization multiplier:
    `X.weight_scale`, per tensor (transformers/vLLM `quant_method: "fp8"` and
    compressed-tensors' tensor strategy) or per output channel `[out, 1]`
    (compressed-tensors' channel strategy), or `X.weight_scale_inv`, one per
    `weight_block_size` block (DeepSeek / Qwen FP8). Each tensor's multiplier is
    spread over its elements and fused with the same function as the weights,
    so fused projections (qkv from q, k and v; the experts stacked from each
    expert's own tensors and scales) keep every part's scale. Where the
    fused multiplier is constant along each output channel (per-tensor and
    per-channel checkpoints) the fp8 bits are kept as written and the channel
    scale is that constant: nothing is rounded again. Block scales vary along a
    channel, so those weights are dequantized in float32 and quantized again per
    channel (as are FP8 checkpoints loaded with `--quantization int8`).
Static activation scales (quantization "fp8_static", jaxllm/quant_config.py): a
layer's one `input_scale` is the largest of its checkpoint tensors' `X.input_scale`
(q, k and v for qkv; every expert's gate and up for stacked experts), the scale
vLLM takes for fused layers. Otherwise activations get a dynamic per-token scale
and the checkpoint's `input_scale` tensors are not read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.layers.quant import quantize_per_channel
from jaxllm.models.contract import WeightSource

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
# Checkpoint tensors of FP8 formats that jaxllm reads no value from.
IGNORED_SUFFIXES = ("input_scale", "output_scale", "k_scale", "v_scale", "q_scale",
                    "kv_scale")
KV_SCALES = ("kv_scales",)  # the decoder's [num_layers, 2] fp8 KV cache scales


def block_size(hf_config: Any) -> tuple[int, int] | None:
    qc = getattr(hf_config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    size = qc.get("weight_block_size")
    return None if size is None else (int(size[0]), int(size[1]))


def scale_path(path: tuple) -> tuple:
    """Where the model holds the per-channel scale of the quantized weight at `path`:
    a `Linear`'s `weight_scale`, stacked experts' `<name>_scale`."""
    if path[-1] == "weight":
        return path[:-1] + ("weight_scale",)
    return path[:-1] + (f"{path[-1]}_scale",)


def input_scale_path(path: tuple) -> tuple:
    """Where the model holds the static activation scale of the weight at `path`."""
    if path[-1] == "weight":
        return path[:-1] + ("input_scale",)
    return path[:-1] + (f"{path[-1]}_input_scale",)


def read_input_scale(src: WeightSource, read: Callable[[str], np.ndarray], names: set[str]
                     ) -> np.ndarray:
    """The static activation scale of one parameter: the largest `input_scale` of its
    checkpoint tensors."""
    found = []
    for tensor in src.tensors:
        name = tensor[:-len("weight")] + "input_scale"
        if name not in names:
            raise ParameterError("model", f"the checkpoint's quantization_config asks for "
                                 f"static activation scales, but {name!r} is missing")
        found.append(float(np.max(np.asarray(read(name), np.float32))))
    return np.asarray(max(found), np.float32)


def scale_name(names: set[str], tensor: str) -> str | None:
    """The checkpoint's dequantization multiplier of weight `tensor`, if it has one."""
    if not tensor.endswith(".weight"):
        return None
    for suffix in SCALE_SUFFIXES:
        name = tensor[:-len("weight")] + suffix
        if name in names:
            return name
    return None


def ignored(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in IGNORED_SUFFIXES


def _elementwise_scale(w: np.ndarray, scale: np.ndarray, name: str,
                       block: tuple[int, int] | None) -> np.ndarray:
    """`scale` spread over every element of `w` `[out, in]`."""
    s = np.asarray(scale, np.float32)
    if s.size == 1:
        return np.broadcast_to(s.reshape(()), w.shape)
    if s.ndim >= 1 and s.shape[0] == w.shape[0] and s.size == w.shape[0]:
        return np.broadcast_to(s.reshape(w.shape[0], 1), w.shape)
    if s.ndim == 2 and w.ndim == 2:
        bo, bi = block or (-(-w.shape[0] // s.shape[0]), -(-w.shape[1] // s.shape[1]))
        full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)
        if full.shape[0] >= w.shape[0] and full.shape[1] >= w.shape[1]:
            return full[:w.shape[0], :w.shape[1]]
    raise ParameterError("model", f"scale {name!r} of shape {s.shape} does not fit weight "
                         f"of shape {w.shape}")


def read_source(src: WeightSource, read: Callable[[str], np.ndarray], names: set[str],
                hf_config: Any, kind: str | None, in_dims: int
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """`(weight, scale)` of one parameter: quantized per output channel to `kind`
    ("fp8" / "int8"), or `(float weight, None)` for a parameter kept in float."""
    tensors = [read(n) for n in src.tensors]
    scales = [scale_name(names, n) for n in src.tensors]
    if all(s is None for s in scales):
        w = src.combine(tensors)
        if kind is None:
            return w, None
        return quantize_per_channel(w, in_dims, kind)
    if any(s is None for s in scales):
        raise ParameterError("model", f"tensors {src.tensors} are fused into one weight but "
                             "only some have a scale")
    block = block_size(hf_config)
    q = src.combine(tensors)
    spread = src.combine([_elementwise_scale(t, read(s), s, block)
                          for t, s in zip(tensors, scales, strict=True)])
    if kind is None:
        return q.astype(np.float32) * spread, None
    out_shape = q.shape[:q.ndim - in_dims]
    channel = spread.reshape(*out_shape, -1)
    if (kind == "fp8" and q.dtype == ml_dtypes.float8_e4m3fn
            and np.all(channel == channel[..., :1])):
        return q, np.ascontiguousarray(channel[..., 0])
    return quantize_per_channel(q.astype(np.float32) * spread, in_dims, kind)


def kv_scales(read: Callable[[str], np.ndarray], names: set[str], num_layers: int
              ) -> np.ndarray:
    """`[num_layers, 2]` K and V scales of an fp8 KV cache: each layer's
    `self_attn.k_scale` / `v_scale` (vLLM's names), compressed-tensors'
    `self_attn.{k,v}_proj.output_scale`, or one `self_attn.kv_scale` for both; 1.0
    where the checkpoint has none (vLLM's default)."""
    out = np.ones((num_layers, 2), np.float32)
    for i in range(num_layers):
        at = f"model.layers.{i}.self_attn."
        for j, x in enumerate("kv"):
            for name in (f"{at}{x}_scale", f"{at}{x}_proj.output_scale", f"{at}kv_scale"):
                if name in names:
                    out[i, j] = float(np.asarray(read(name), np.float32).reshape(-1)[0])
                    break
    return out
