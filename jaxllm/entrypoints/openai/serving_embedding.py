"""/v1/embeddings: one pooling request per input, for encoder and decoder models alike; and
the pooling requests the other pooling routes (serving_score.py) share."""

from __future__ import annotations

import base64

import numpy as np

from jaxllm.engine.async_llm import RequestOutputCollector
from jaxllm.engine.input_processor import PromptType
from jaxllm.entrypoints.openai.protocol import UsageInfo
from jaxllm.entrypoints.openai.protocol_embedding import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
)
from jaxllm.entrypoints.openai.serving_engine import (
    HTTPError,
    OpenAIServing,
    raise_if_failed,
    random_id,
)
from jaxllm.errors import ParameterError
from jaxllm.outputs import PoolingRequestOutput
from jaxllm.sampling_params import PoolingParams


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise ParameterError("input", "must not be empty")
    if all(isinstance(v, int) for v in value):
        return [{"prompt_token_ids": list(value)}]
    out: list[PromptType] = []
    for v in value:
        if isinstance(v, list) and not v:
            raise ParameterError("input", "each list of token ids must be non-empty")
        out.append(v if isinstance(v, str) else {"prompt_token_ids": v})
    return out


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """`vector` as the body carries it: floats, or base64 of its float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, req: EmbeddingRequest) -> EmbeddingResponse:
        model = self.check_model(req.model)
        req.check_strings()
        self.check_embeds("Embeddings")
        prompts = [self._tokenized(p, req.add_special_tokens) for p in _inputs(req.input)]
        request_id = random_id("embd")
        outs = await self.pool(prompts, PoolingParams(task="embed", normalize=req.normalize,
                                                      dimensions=req.dimensions),
                               req.priority, request_id, ["input"] * len(prompts))
        data = [EmbeddingData(index=i, embedding=encode_embedding(out.outputs.embedding,
                                                                  req.encoding_format))
                for i, out in enumerate(outs)]
        num_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return EmbeddingResponse(id=request_id, model=model, data=data,
                                 usage=UsageInfo(prompt_tokens=num_tokens,
                                                 total_tokens=num_tokens))

    def check_embeds(self, api: str) -> None:
        self.check_task("embed", api)

    def check_task(self, task: str, api: str) -> None:
        """A 400 naming the model where it does not serve `task` (vLLM's names)."""
        tasks = self.model_config.supported_tasks
        if task in tasks:
            return
        if "classify" in tasks:
            hint = ("a score needs a single label: num_labels 1" if task == "score" else
                    f"it is a cross-encoder: it serves {' and '.join(tasks)}")
        elif task == "embed":
            hint = "start it with --runner pooling"
        else:
            hint = "only a cross-encoder (a sequence classifier) does"
        raise HTTPError(400, f"The model does not support {api} API ({hint})", "model")

    async def pool(self, prompts: list[PromptType],
                   params: PoolingParams | list[PoolingParams], priority: int,
                   request_id: str, fields: list[str]) -> list[PoolingRequestOutput]:
        """Every prompt's pooled output, in order (`params`: one for all, or one each); a
        bad prompt is an error naming its entry of `fields` (the body's field it came
        from)."""
        self.check_alive()
        added: list[tuple[str, RequestOutputCollector]] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{request_id}-{i}"
                p = params[i] if isinstance(params, list) else params
                added.append((rid, self.engine.add_request(rid, prompt, p, priority)))
        except ParameterError as e:
            self.engine.abort_now([rid for rid, _ in added])
            if e.field in ("prompt", "prompt_token_ids"):
                raise ParameterError(fields[len(added)], e.message) from e
            raise
        except BaseException:
            self.engine.abort_now([rid for rid, _ in added])
            raise
        outs = await self.collect(added)
        for out in outs:
            if not isinstance(out, PoolingRequestOutput):
                raise_if_failed(out)  # the core rejected it
                raise HTTPError(500, "the engine returned no pooled output")
        return outs

    def _tokenized(self, prompt: PromptType, add_special_tokens: bool) -> PromptType:
        """A text input with its token ids, [CLS]/[SEP] and the like only if asked."""
        if not isinstance(prompt, str) or self.tokenizer is None:
            return prompt
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        return {"prompt": prompt, "prompt_token_ids": ids}
