"""vLLM's /score and /rerank: an embedding model scores each pair of texts by the cosine
similarity of their embeddings, a cross-encoder by running the pair through the model
(entrypoints/score_utils.py); rerank in the shape Jina's and Cohere's clients read
(results best first, `top_n` of them); and the routes of the pooling APIs,
/v1/embeddings and /classify with them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from jaxllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo
from jaxllm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from jaxllm.entrypoints.openai.serving_classify import (
    ClassificationRequest,
    OpenAIServingClassify,
)
from jaxllm.entrypoints.openai.serving_engine import random_id
from jaxllm.entrypoints.score_utils import (
    check_pairs,
    cross_encoder_pairs,
    cross_encoder_scores,
    is_cross_encoder,
    pair_scores,
)
from jaxllm.errors import ParameterError
from jaxllm.outputs import ScoringRequestOutput
from jaxllm.sampling_params import PoolingParams


class ScoreRequest(OpenAIBaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = 0


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(OpenAIBaseModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0  # 0: every document
    priority: int = 0


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class OpenAIServingScore(OpenAIServingClassify):
    """Every pooling API: embeddings, classification, scores and reranking."""

    async def create_score(self, req: ScoreRequest) -> ScoreResponse:
        model = self.check_model(req.model)
        req.check_strings()
        request_id = random_id("score")
        scores = await self._scores(_texts(req.text_1), _texts(req.text_2),
                                    ("text_1", "text_2"), req.priority, request_id)
        tokens = sum(len(s.prompt_token_ids) for s in scores)
        return ScoreResponse(id=request_id, model=model,
                             data=[ScoreData(index=i, score=s.outputs.score)
                                   for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

    async def create_rerank(self, req: RerankRequest) -> RerankResponse:
        model = self.check_model(req.model)
        req.check_strings()
        if req.top_n < 0:
            raise ParameterError("top_n", f"must be at least 0 (0: every document), got "
                                 f"{req.top_n}")
        request_id = random_id("rerank")
        scores = await self._scores([req.query], req.documents, ("query", "documents"),
                                    req.priority, request_id)
        order = sorted(range(len(scores)), key=lambda i: -scores[i].outputs.score)
        results = [RerankResult(index=i, document=RerankDocument(text=req.documents[i]),
                                relevance_score=scores[i].outputs.score)
                   for i in order[:req.top_n or None]]
        tokens = sum(len(s.prompt_token_ids) for s in scores)
        return RerankResponse(id=request_id, model=model, results=results,
                              usage=RerankUsage(total_tokens=tokens))

    async def _scores(self, first: list[str], second: list[str], names: tuple[str, str],
                      priority: int, request_id: str) -> list[ScoringRequestOutput]:
        """The pairs' scores, all in one batch: a cross-encoder's of each pair's encoding,
        else the cosine similarities of the texts' embeddings (each text embedded once)."""
        tasks = self.model_config.supported_tasks
        self.check_task("score" if is_cross_encoder(tasks) else "embed", "Score")
        check_pairs(len(first), len(second), names)
        if is_cross_encoder(tasks):
            pairs = cross_encoder_pairs(self.tokenizer, first, second, names,
                                        self.model_config.max_model_len)
            outs = await self.pool([{"prompt_token_ids": ids} for ids, _ in pairs],
                                   [PoolingParams(task="score", token_type_start=start)
                                    for _, start in pairs],
                                   priority, request_id, [names[1]] * len(pairs))
            return cross_encoder_scores(outs)
        prompts = [self._tokenized(t, True) for t in first + second]
        fields = [names[0]] * len(first) + [names[1]] * len(second)
        outs = await self.pool(prompts, PoolingParams(task="embed"), priority, request_id,
                               fields)
        return pair_scores(outs[:len(first)], outs[len(first):],
                           getattr(self.tokenizer, "pad_token_id", None))


def add_pooling_routes(app: FastAPI, serving: OpenAIServingScore, respond: Callable,
                       until_disconnect: Callable) -> None:
    """The pooling APIs' routes: POST /v1/embeddings; /classify; /score and /v1/score;
    /rerank, /v1/rerank and /v2/rerank, as vLLM serves them. Each request is aborted if
    its client goes away (`until_disconnect`)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Any:
        return respond(await until_disconnect(raw, serving.create_embedding(body)))

    @app.post("/classify")
    async def classify(body: ClassificationRequest, raw: Request) -> Any:
        return respond(await until_disconnect(raw, serving.create_classify(body)))

    async def score(body: ScoreRequest, raw: Request) -> Any:
        return respond(await until_disconnect(raw, serving.create_score(body)))

    async def rerank(body: RerankRequest, raw: Request) -> Any:
        return respond(await until_disconnect(raw, serving.create_rerank(body)))

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)
