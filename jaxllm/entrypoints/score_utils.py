"""Scores of text pairs from an embedding model's embeddings (vLLM's bi-encoder scoring):
the cosine similarity of each pair, for `LLM.score` and the /score and /rerank routes."""

from __future__ import annotations

import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput


def check_pairs(first: int, second: int, names: tuple[str, str]) -> None:
    """Counts of the two sides that pair 1:1, 1:N (the first side's one text against each
    of the second's) or N:N; else an error naming the side at fault."""
    if not first or not second:
        raise ParameterError(names[0] if not first else names[1],
                             "at least one text must be given")
    if first not in (1, second):
        raise ParameterError(names[0], f"{first} texts for {second} in {names[1]}: the "
                             "lengths must be 1:1, 1:N or N:N")


def pair_scores(left: list[PoolingRequestOutput], right: list[PoolingRequestOutput],
                pad: int | None) -> list[ScoringRequestOutput]:
    """One score per pair of `left` (one, or as many as `right`) and `right` embeddings.
    A pair's tokens are its first text's, the pad token (as vLLM joins them), then its
    second's."""
    if len(left) == 1:
        left = left * len(right)
    return [_cosine(a, b, pad) for a, b in zip(left, right, strict=True)]


def _cosine(a: PoolingRequestOutput, b: PoolingRequestOutput,
            pad: int | None) -> ScoringRequestOutput:
    x, y = np.asarray(a.outputs.data, np.float64), np.asarray(b.outputs.data, np.float64)
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    score = float(x @ y) / norms if norms > 0 else 0.0
    tokens = a.prompt_token_ids + ([pad] if pad is not None else []) + b.prompt_token_ids
    return ScoringRequestOutput(f"{a.request_id}_{b.request_id}", tokens, ScoringOutput(score))
