"""MXFP4 weights (OCP microscaling FP4, GPT-OSS's released experts) dequantized on the host.

A checkpoint stores each stacked expert weight `X` as `X_blocks` `[..., out, G, 16]`
uint8, two e2m1 values per byte (the low nibble first), and `X_scales` `[..., out, G]`
uint8, one e8m0 exponent per 32 values along the input axis (value * 2^(scale - 127)),
in the `[out, in]` orientation, `in = 32 G` (transformers' integrations/mxfp4.py,
`convert_moe_packed_tensors`, is the layout's reference). jaxllm serves the weights
dequantized in the model dtype; every e2m1 value times a power of two is exact in
bfloat16, so `dequantize` writes bfloat16 and a later cast to float32 loses nothing.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from jaxllm.errors import ParameterError

# e2m1 code -> value: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale
SCALE_BIAS = 127  # e8m0's exponent bias


def is_mxfp4(hf_config: object) -> bool:
    """Whether the config's `quantization_config` says MXFP4 (`quant_method: "mxfp4"`)."""
    qc = getattr(hf_config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return qc.get("quant_method") == "mxfp4"


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype = ml_dtypes.bfloat16,
               name: str = "blocks") -> np.ndarray:
    """`blocks [..., G, 16]` and `scales [..., G]` as `[..., 32 G]` values of `dtype`.
    A 4-D stack goes one expert (leading index) at a time, on a few threads, so the
    float32 intermediates stay a few experts' size. A scale byte of 255 (e8m0's NaN)
    gives infinities and NaNs, not an error."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim < 2
            or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape):
        raise ParameterError("model", f"MXFP4 tensor {name!r}: blocks {blocks.shape} "
                             f"{blocks.dtype} and scales {scales.shape} {scales.dtype} are not "
                             f"uint8 [..., G, {BLOCK // 2}] and uint8 [..., G]")
    out = np.empty((*scales.shape[:-1], scales.shape[-1] * BLOCK), dtype)
    if blocks.ndim <= 3:
        _fill(out, blocks, scales)
        return out
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda i: _fill(out[i], blocks[i], scales[i]), range(len(out))))
    return out


# Byte -> its two values, the low nibble's first.
_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], -1)


def _fill(out: np.ndarray, blocks: np.ndarray, scales: np.ndarray) -> None:
    """`out[...]` = the values of `blocks` and `scales` (`dequantize`'s arguments)."""
    values = np.take(_PAIRS, blocks, axis=0).reshape(*scales.shape, BLOCK)
    # Times a power of two: exact, as ldexp, for every finite scale (large ones overflow
    # to infinity, as ldexp does).
    with np.errstate(over="ignore"):
        values *= np.ldexp(np.float32(1), scales.astype(np.int32) - SCALE_BIAS)[..., None]
    values = values.reshape(out.shape)
    if out.dtype == ml_dtypes.bfloat16:  # each value is a bfloat16 one: its top 16 bits
        out.view(np.uint16)[...] = values.view(np.uint32) >> 16
    else:
        out[...] = values
