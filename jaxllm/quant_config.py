"""Which weight quantization and KV cache dtype an engine runs (`EngineArgs`' checks).

`quantization`: None, "fp8" or "int8" (jaxllm/layers/quant.py), or what the
checkpoint's `quantization_config` (or a jaxllm orbax checkpoint's metadata)
says: "fp8", or "fp8_static" for FP8 weights with static activation scales
(`activation_scheme: "static"`, compressed-tensors' non-dynamic per-tensor
input activations), which `--quantization fp8` accepts too; `kv_cache_dtype`:
vLLM's "auto" (the model dtype), "fp8" / "fp8_e4m3". GPT-OSS's MXFP4 experts
(`quant_method: "mxfp4"`) are dequantized on load (models/mxfp4.py), so the model is a
float one: it serves in `--dtype`, and `--quantization fp8|int8` may quantize it as it
would any float checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxllm.errors import ParameterError

_QUANTIZATIONS = ("fp8", "int8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3


def kv_cache_dtype(model_config: Any) -> str:
    """The KV cache's dtype: the model's for "auto", else float8_e4m3fn."""
    return model_config.dtype if model_config.kv_cache_dtype == "auto" else "float8_e4m3fn"


def _checkpoint_quantization(raw: dict) -> str | None:
    """The quantization a config.json's `quantization_config` implies (None: float
    weights): transformers' / vLLM's `quant_method: "fp8"`, or compressed-tensors with
    8-bit float weights."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":  # float weights once dequantized on load
        if raw.get("model_type") != "gpt_oss":
            raise ParameterError("config.json:quantization_config",
                                 "quant_method 'mxfp4' is read for GPT-OSS's experts only, "
                                 f"not model_type {raw.get('model_type')!r}")
        return None
    if method == "fp8":
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ParameterError("config.json:quantization_config.activation_scheme",
                                 f"must be 'dynamic' or 'static', got {scheme!r}")
        return "fp8_static" if scheme == "static" else "fp8"
    if method == "compressed-tensors":
        static = False
        for group in (qc.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ParameterError("config.json:quantization_config",
                                     "compressed-tensors is read for 8-bit float weights "
                                     f"only, got {weights}")
            acts = group.get("input_activations") or {}
            if acts and not acts.get("dynamic", True):
                if acts.get("strategy") != "tensor":
                    raise ParameterError("config.json:quantization_config",
                                         "static input activations are read per tensor "
                                         f"only, got {acts}")
                static = True
        return "fp8_static" if static else "fp8"
    raise ParameterError("config.json:quantization_config",
                         f"quant_method {method!r} is not supported (supported: 'fp8', "
                         "'compressed-tensors' with 8-bit float weights, GPT-OSS's "
                         "'mxfp4')")


def resolve_quantization(requested: str | None, kv_cache_dtype: str, raw: dict,
                         model: str) -> dict[str, Any]:
    """ModelConfig's `quantization` and `kv_cache_dtype` for the requested values and
    the checkpoint (config.json `raw` in directory `model`)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ParameterError("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got "
                             f"{kv_cache_dtype!r}")
    if requested is not None and requested not in _QUANTIZATIONS:
        raise ParameterError("quantization", f"must be one of {_QUANTIZATIONS} or None, "
                             f"got {requested!r}")
    stored = _checkpoint_quantization(raw)
    orbax_meta = os.path.join(model, "jaxllm_orbax.json")  # models/orbax_io.py's metadata
    if stored is None and os.path.isfile(orbax_meta):
        with open(orbax_meta) as f:
            stored = json.load(f).get("quantization")
    if stored is not None and requested not in (None, stored.removesuffix("_static")):
        # As vLLM: a quantized checkpoint runs in its own format.
        raise ParameterError("quantization", f"{requested!r}, but the checkpoint is already "
                             f"quantized as {stored!r}")
    return {"quantization": stored or requested, "kv_cache_dtype": kv_cache_dtype}
