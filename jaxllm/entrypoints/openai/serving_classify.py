"""vLLM's /classify for cross-encoders (sequence classifiers): each input's class
probabilities, its most probable label (the config's `id2label`) and the label count."""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
from pydantic import Field

from jaxllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo
from jaxllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jaxllm.entrypoints.openai.serving_engine import random_id
from jaxllm.errors import ParameterError
from jaxllm.sampling_params import PoolingParams


class ClassificationRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str]
    user: str | None = None
    # vLLM's extra fields.
    add_special_tokens: bool = True
    priority: int = 0


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


def label_of(id2label: Any, index: int) -> str | None:
    """`id2label`'s name for a label index (its keys are ints, or strings from JSON)."""
    if not isinstance(id2label, dict):
        return None
    name = id2label.get(index, id2label.get(str(index)))
    return None if name is None else str(name)


class OpenAIServingClassify(OpenAIServingEmbedding):
    async def create_classify(self, req: ClassificationRequest) -> ClassificationResponse:
        model = self.check_model(req.model)
        req.check_strings()
        self.check_task("classify", "Classification")
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts:
            raise ParameterError("input", "must not be empty")
        prompts = [self._tokenized(t, req.add_special_tokens) for t in texts]
        request_id = random_id("classify")
        outs = await self.pool(prompts, PoolingParams(task="classify"), req.priority,
                               request_id, ["input"] * len(prompts))
        id2label = getattr(self.model_config.hf_config, "id2label", None)
        data = [ClassificationData(index=i, label=label_of(id2label,
                                                           int(np.argmax(o.outputs.data))),
                                   probs=o.outputs.data, num_classes=len(o.outputs.data))
                for i, o in enumerate(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return ClassificationResponse(id=request_id, model=model, data=data,
                                      usage=UsageInfo(prompt_tokens=tokens,
                                                      total_tokens=tokens))
