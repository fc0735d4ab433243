"""Which requests speculative decoding drafts for."""

from __future__ import annotations

from jaxllm.sampling_params import SamplingParams


def can_draft(params: SamplingParams | None) -> bool:
    """Whether a request's tokens may be drafted: its sampling reads no output history,
    adjusts no logits and scores no prompt (the verify sampler does none of those)."""
    return params is not None and not (
        params.needs_penalties or params.bad_words_token_ids or params.min_tokens
        or params.logit_bias or params.allowed_token_ids
        or params.structured_outputs is not None or params.prompt_logprobs is not None)
