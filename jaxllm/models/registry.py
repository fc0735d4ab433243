"""Hugging Face architecture name -> the Flax NNX class that implements it.

Every causal LM implements the model contract (models/contract.py) as a
configuration of the generic decoder (models/decoder.py); an encoder
(`is_encoder`, models/bert.py) runs under the encoder runner instead, and a
cross-encoder (`is_classifier`, models/cross_encoder.py) is an encoder with a
classification head. A multimodal checkpoint is served as its language model's
architecture (models/multimodal.py).
"""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError
from jaxllm.models.bert import BertModel, RobertaModel
from jaxllm.models.cohere import CohereForCausalLM
from jaxllm.models.cross_encoder import (
    BertForSequenceClassification,
    RobertaForSequenceClassification,
    num_labels,
)
from jaxllm.models.deepseek import DeepseekForCausalLM
from jaxllm.models.exaone import Exaone4ForCausalLM
from jaxllm.models.gemma import GemmaForCausalLM
from jaxllm.models.glm import GlmForCausalLM
from jaxllm.models.gpt_oss import GptOssForCausalLM
from jaxllm.models.granite import GraniteForCausalLM
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.moe import MoEForCausalLM
from jaxllm.models.multimodal import TEXT_ARCHITECTURES
from jaxllm.models.nongated import NonGatedForCausalLM
from jaxllm.models.olmo import OlmoForCausalLM
from jaxllm.models.phi3 import Phi3ForCausalLM

_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MinistralForCausalLM": LlamaForCausalLM,
    "Ministral3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "SeedOssForCausalLM": LlamaForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": GlmForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": OlmoForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "ArceeForCausalLM": NonGatedForCausalLM,
    "ApertusForCausalLM": NonGatedForCausalLM,
    "Cohere2ForCausalLM": CohereForCausalLM,
    "Olmo3ForCausalLM": OlmoForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Glm4MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "BertModel": BertModel,
    "RobertaModel": RobertaModel,
    "XLMRobertaModel": RobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
}


def is_encoder_architecture(architecture: str) -> bool:
    """Whether the architecture is an encoder (whole prompts, no KV cache, pooling only)."""
    return bool(getattr(_MODELS.get(architecture), "is_encoder", False))


def classifier_labels(architecture: str, hf_config: Any) -> int | None:
    """A cross-encoder's label count (it classifies and scores, not embeds); None for
    any other architecture."""
    if not getattr(_MODELS.get(architecture), "is_classifier", False):
        return None
    return num_labels(hf_config)


def usable_positions(architecture: str, hf_config: Any) -> int | None:
    """The longest prompt an encoder's position table holds (None: not an encoder)."""
    cls = _MODELS.get(architecture)
    if not getattr(cls, "is_encoder", False):
        return None
    return cls.arch_from_hf_config(hf_config).usable_positions


def supported_architectures() -> list[str]:
    """Every `architectures[0]` jaxllm serves: its own and the multimodal ones (as text)."""
    return sorted([*_MODELS, *TEXT_ARCHITECTURES])


def get_model_class(architecture: str) -> type:
    """The model class for an HF `architectures[0]` name."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ParameterError(
            "model", f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}") from None
