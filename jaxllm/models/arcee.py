"""Arcee's AFM (`ArceeForCausalLM`) on the generic decoder: Llama's attention, norms and
rope (llama3 or yarn scaling) with a non-gated MLP, `down(relu(up x) ** 2)` by default
(`hidden_act`; layers/gated_mlp.PlainMLP)."""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.layers.gated_mlp import PLAIN_ACTIVATIONS
from jaxllm.models.decoder import DecoderForCausalLM
from jaxllm.models.decoder_arch import DecoderArch, common_fields


def arcee_arch(cfg: Any, tensor_parallel_size: int = 1) -> DecoderArch:
    """An Arcee config as a `DecoderArch`."""
    model_type = getattr(cfg, "model_type", None)
    if model_type != "arcee":
        raise ParameterError("model", f"model_type {model_type!r} is not an Arcee model; "
                             "supported: arcee")
    act = getattr(cfg, "hidden_act", "relu2")
    if act not in PLAIN_ACTIVATIONS:
        raise ParameterError("config.json:hidden_act", f"{act!r} is not supported; supported: "
                             f"{', '.join(map(repr, sorted(PLAIN_ACTIVATIONS)))}")
    fields = common_fields(cfg, tensor_parallel_size)
    bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderArch(**fields, qkv_bias=bias, o_bias=bias,
                       mlp_bias=bool(getattr(cfg, "mlp_bias", False)), qk_norm=False,
                       mlp_kinds=("plain",) * fields["num_layers"],
                       activation=PLAIN_ACTIVATIONS[act])


class ArceeForCausalLM(DecoderForCausalLM):
    """Arcee AFM causal LM over a ragged, paged batch."""

    arch_from_hf_config = staticmethod(arcee_arch)
