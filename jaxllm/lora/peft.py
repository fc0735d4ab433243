"""Reading a PEFT LoRA adapter directory into per-layer, per-module `(A, B)` arrays.

A PEFT directory holds `adapter_config.json` (rank `r`, `lora_alpha`,
`target_modules`, `use_rslora`) and `adapter_model.safetensors` with tensors
named `...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A `[r, in]`
and B `[out, r]`. The scale `lora_alpha / r` (`lora_alpha / sqrt(r)` with
rsLoRA) is folded into B here, so the device computes `(x @ A.T) @ B.T`. An
adapter of a multimodal model (models/multimodal.py) names the language model's
modules in either layout; its vision tower's and projector's tensors are skipped,
as vLLM skips them: a text request runs neither.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.request import LoRARequest
from jaxllm.models.multimodal import text_tensor_name

# The projections an adapter may target (PEFT module names of the decoders; Phi-3's
# checkpoints fuse q/k/v and gate/up into one module each).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "qkv_proj", "gate_up_proj")
_PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """One adapter on the host: `weights[(layer, module)] = (A [r, in], B*scale [out, r])`."""

    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def _field(path: str, name: str) -> str:
    return f"{os.path.join(path, 'adapter_config.json')}:{name}"


def load_peft_adapter(path: str, max_lora_rank: int) -> PeftAdapter:
    """The adapter in PEFT directory `path`; a clear error for what it cannot serve."""
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise ParameterError("lora_path", f"{path!r} has no adapter_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ParameterError(_field(path, "peft_type"), f"{cfg['peft_type']!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ParameterError(_field(path, "r"), f"must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ParameterError("max_lora_rank", f"adapter {path!r} has rank r={rank}, more than "
                             f"max_lora_rank={max_lora_rank}")
    for unsupported in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(unsupported):
            raise ParameterError(_field(path, unsupported), "is not supported")
    if cfg.get("bias", "none") != "none":
        raise ParameterError(_field(path, "bias"), f"{cfg['bias']!r} is not supported; only 'none'")
    alpha = cfg.get("lora_alpha", rank)
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    tensors = _read_tensors(path)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        module_path = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        if text_tensor_name(module_path) is None:
            continue
        m = _TENSOR.search(name)
        if m is None:
            raise ParameterError("lora_path", f"{path!r}: tensor {name!r} is not a LoRA "
                                 f"weight of {', '.join(SUPPORTED_MODULES)}")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            raise ParameterError(_field(path, "target_modules"),
                                 f"{module!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_MODULES)}")
        halves.setdefault((layer, module), {})[half] = value.astype(np.float32)
    weights = {}
    for key, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ParameterError("lora_path", f"{path!r}: {key[1]} of layer {key[0]} lacks "
                                 "lora_A or lora_B")
        weights[key] = (ab["A"], ab["B"] * np.float32(scale))
    return PeftAdapter(rank, scale, weights)


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        try:
            return load_file(st)
        except TypeError:  # bfloat16 has no numpy dtype: read through torch
            pass
    from safetensors.torch import load_file as load_torch
    if not os.path.isfile(st):
        raise ParameterError("lora_path", f"{path!r} has no adapter_model.safetensors")
    return {k: v.float().numpy() for k, v in load_torch(st).items()}


def check_lora_request(lora_request: LoRARequest | None, lora_config: LoRAConfig | None) -> None:
    """A request's adapter, checked where it enters the engine: LoRA must be enabled
    and the adapter's directory readable with a rank that fits the slots."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise ParameterError("lora_request", f"must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
    if lora_config is None:
        raise ParameterError("lora_request", "LoRA is not enabled (start the engine with "
                             "enable_lora=True / --enable-lora)")
    path = lora_request.lora_path
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            rank = json.load(f).get("r")
    except (OSError, ValueError) as e:
        raise ParameterError("lora_path", f"cannot read the adapter at {path!r}: {e}") from None
    if isinstance(rank, int) and rank > lora_config.max_lora_rank:
        raise ParameterError("max_lora_rank", f"adapter {lora_request.lora_name!r} has rank "
                             f"r={rank}, more than max_lora_rank={lora_config.max_lora_rank}")
