"""The families with a non-gated MLP `down(act(up x))` (layers/gated_mlp.PlainMLP) on the
generic decoder: Arcee's AFM (`ArceeForCausalLM`: Llama's attention and norms, ReLU² by
default) and Swiss AI's Apertus (`ApertusForCausalLM`: per-head q/k RMSNorm, norms named
`attention_layernorm` / `feedforward_layernorm`, and xIELU, whose four learned scalars
per layer load from `mlp.act_fn.*`)."""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.layers.gated_mlp import PLAIN_ACTIVATIONS
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import DecoderArch, checked_model_type, common_fields

MODEL_TYPES = ("arcee", "apertus")
APERTUS_NORMS = ("attention_layernorm", "feedforward_layernorm")


def nongated_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """An Arcee or Apertus config as a `DecoderArch`."""
    model_type = checked_model_type(cfg, MODEL_TYPES, "Arcee or Apertus")
    act = getattr(cfg, "hidden_act", None) or ("relu2" if model_type == "arcee" else "xielu")
    if act not in PLAIN_ACTIVATIONS:
        raise ParameterError("config.json:hidden_act", f"{act!r} is not supported; supported: "
                             f"{', '.join(map(repr, sorted(PLAIN_ACTIVATIONS)))}")
    fields = common_fields(cfg, tensor_parallel_size)
    bias = bool(getattr(cfg, "attention_bias", False))
    apertus = model_type == "apertus"
    extra = dict(norm_names=APERTUS_NORMS) if apertus else {}
    return DecoderArch(**fields, qkv_bias=bias, o_bias=bias,
                       mlp_bias=bool(getattr(cfg, "mlp_bias", False)), qk_norm=apertus,
                       mlp_kinds=("plain",) * fields["num_layers"],
                       activation=PLAIN_ACTIVATIONS[act], **extra)


class NonGatedForCausalLM(DecoderForCausalLM):
    """Arcee AFM / Apertus causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(nongated_arch)
