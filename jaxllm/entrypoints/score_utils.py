"""Scores of text pairs, for `LLM.score` and the /score and /rerank routes, as vLLM's: an
embedding model's are the cosine similarity of each pair's embeddings (a bi-encoder); a
cross-encoder's come from running each pair through the model as one text-pair encoding."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput


def is_cross_encoder(supported_tasks: tuple[str, ...]) -> bool:
    """Whether a model of these tasks scores pairs as a cross-encoder (a classifier)."""
    return "classify" in supported_tasks


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


def cross_encoder_pairs(tokenizer: Any, first: list[Any], second: list[Any],
                        names: tuple[str, str], max_len: int
                        ) -> list[tuple[list[int], int | None]]:
    """Each pair (1:1, 1:N or N:N, checked by `check_pairs`) as the tokenizer's text-pair
    encoding (BERT's `[CLS] a [SEP] b [SEP]`, RoBERTa's `<s> a </s></s> b </s>`): its
    token ids, and where token type 1 begins (None: the tokenizer gives no types, or
    none is 1). A pair longer than `max_len` is an error naming the side of the longer
    text."""
    if tokenizer is None:
        raise ParameterError(names[0], "a cross-encoder scores text pairs, which needs a "
                             "tokenizer (skip_tokenizer_init=True leaves none)")
    for name, side in zip(names, (first, second), strict=True):
        if not all(isinstance(t, str) for t in side):
            raise ParameterError(name, "a cross-encoder scores text pairs: each entry must "
                                 "be a string")
    left = first * len(second) if len(first) == 1 else first
    out = []
    for i, (a, b) in enumerate(zip(left, second, strict=True)):
        enc = tokenizer(a, b)
        ids, types = list(enc["input_ids"]), enc.get("token_type_ids")
        if len(ids) > max_len:
            j = 0 if len(first) == 1 else i
            raise ParameterError(names[0] if len(a) > len(b) else names[1],
                                 f"the pair of {names[0]}[{j}] and {names[1]}[{i}] has "
                                 f"{len(ids)} tokens, more than this model takes "
                                 f"(max_model_len {max_len})")
        start = next((k for k, t in enumerate(types or ()) if t), None)
        if start is not None and any(t != 1 for t in types[start:]):
            raise ParameterError("tokenizer", "its text-pair token types are not a run of "
                                 "0s then 1s")
        out.append((ids, start))
    return out


def cross_encoder_scores(outs: list[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
    """A cross-encoder's pair outputs (one activated logit each) as scores."""
    return [ScoringRequestOutput(o.request_id, o.prompt_token_ids,
                                 ScoringOutput(float(o.outputs.data[0]))) for o in outs]
