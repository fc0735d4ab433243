"""Multimodal checkpoints served for text as their language model: Gemma 3
(`Gemma3ForConditionalGeneration`), Mistral 3 (`Mistral3ForConditionalGeneration`:
Mistral Small 3.1/3.2 with a Mistral text model, the Ministral 3 releases with a
Ministral 3 one), and Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense), whose multimodal rope
is the text model's rope for text tokens.

`text_model_config` turns such a checkpoint's config into its language model's
config under that model's text architecture, once, so everything downstream
(the model, the KV cache, the mesh, LoRA, conversion) reads a text decoder's
config; `text_tensor_name` reads the checkpoint's tensor names as that text
model's. Two layouts are read: the hub's released checkpoints (and
transformers' `save_pretrained`) name the language model `language_model.model.*`
and `language_model.lm_head.*`; transformers' module tree, which other
exporters write, names it `model.language_model.*` and `lm_head.*` (Qwen2/2.5-VL's
releases: `model.*` and `lm_head.*` as a text model's). The vision tower and the
projector (Qwen's `visual`) are stored but never read: a text request runs neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.models.safetensors_files import stored_tensor_names

# Wrapper architecture -> {its text config's model_type: the text architecture}.
TEXT_ARCHITECTURES: dict[str, dict[str, str]] = {
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Mistral3ForConditionalGeneration": {"mistral": "MistralForCausalLM",
                                         "ministral3": "Ministral3ForCausalLM"},
    # Their multimodal rope rotates a text token by its position on all three axes, which
    # is the text model's own rope (models/llama.py reads the text model types).
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM"},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
    "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": "Qwen3ForCausalLM"},
}
# (stored prefix, the text model's prefix), in both layouts.
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."))
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.", "visual.", "model.visual.")


def config_keys(raw: dict[str, Any]) -> tuple[str, ...]:
    """The keys config.json must hold; a multimodal config keeps its language model's
    fields in `text_config`, where transformers' defaults fill what a released config
    leaves out."""
    if (raw.get("architectures") or ["?"])[0] in TEXT_ARCHITECTURES:
        return ("architectures", "text_config")
    return ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")


def text_model_of(hf_config: Any, model_dir: str) -> tuple[Any, str | None]:
    """(the config the engine serves, the multimodal architecture it came from or None):
    `text_model_config` of a multimodal checkpoint's config, else `hf_config` itself."""
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if architecture not in TEXT_ARCHITECTURES:
        return hf_config, None
    return text_model_config(hf_config, stored_tensor_names(model_dir)), architecture


def text_tensor_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor `name` as its text model names it, or None for
    a tensor of the vision tower or projector. Other names are kept, so that a tensor
    neither part owns stays unexpected to the loader."""
    if name.startswith(VISION_PREFIXES):
        return None
    for stored, text in _RENAMES:
        if name.startswith(stored):
            return text + name[len(stored):]
    return name


def text_model_config(hf_config: Any, stored_names: Iterable[str]) -> Any:
    """The language model's config of a multimodal `hf_config` (a transformers config
    of an architecture in TEXT_ARCHITECTURES), its `architectures` the text one.

    What the text model needs from the outer config moves onto it: the dtype, a
    `quantization_config`, and whether the logits head is the embedding matrix,
    which transformers reads from the outer config and drops where the checkpoint
    stores a head of its own (`stored_names`: the checkpoint's tensor names; none
    for an orbax checkpoint, whose converted config.json says it)."""
    architecture = hf_config.architectures[0]
    text = getattr(hf_config, "text_config", None)
    if text is None:
        raise ParameterError("config.json:text_config", f"missing; {architecture} keeps its "
                             "language model's config there")
    model_type = getattr(text, "model_type", None)
    supported = TEXT_ARCHITECTURES[architecture]
    if model_type not in supported:
        raise ParameterError("config.json:text_config.model_type",
                             f"{model_type!r} is not supported for {architecture}; "
                             f"supported: {', '.join(map(repr, supported))}")
    text.architectures = [supported[model_type]]
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf_config, "dtype", None)
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization and not getattr(text, "quantization_config", None):
        text.quantization_config = quantization
    own_head = any(text_tensor_name(n) == "lm_head.weight" for n in stored_names)
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True)) \
        and not own_head
    return text
