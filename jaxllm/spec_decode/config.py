"""vLLM's `speculative_config`, checked: the method, its draft model and how many drafts a
step verifies."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from jaxllm.errors import ParameterError

# What this engine drafts with (vLLM's `method` names).
SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model",)  # the methods that run a model of their own (`model`)
HEAD_METHODS = ("eagle", "eagle3")  # a head over the target's hidden states (`model`)


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config`: how drafts are proposed, and how many per step."""

    method: str = "ngram"
    num_speculative_tokens: int = 1
    # ngram (prompt lookup): the longest and shortest suffix matched in the context.
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    model: str | None = None  # a draft model's checkpoint (draft_model / eagle methods)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """Checks vLLM's fields (a dict or its JSON text); None when speculation is off."""
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ParameterError("speculative_config", f"not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ParameterError("speculative_config", "must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ParameterError("speculative_config", f"unknown fields {sorted(unknown)}; "
                                 f"known: {sorted(known)}")
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method not in SPEC_METHODS:
            raise ParameterError("speculative_config.method",
                                 f"{method!r} is not supported; supported: {list(SPEC_METHODS)}")
        model = raw.get("model")
        needs_dir = method in MODEL_METHODS + HEAD_METHODS
        if needs_dir and not (isinstance(model, str) and os.path.isdir(model)):
            raise ParameterError("speculative_config.model",
                                 f"method {method!r} needs a checkpoint directory, got {model!r}")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ParameterError("speculative_config.num_speculative_tokens",
                                 f"must be an integer in [1, 16], got {k!r}")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        # As vLLM: one bound given sets the other; neither gives the defaults.
        lo, hi = (lo if lo is not None else (hi if hi is not None else cls.prompt_lookup_min),
                  hi if hi is not None else (lo if lo is not None else cls.prompt_lookup_max))
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParameterError(f"speculative_config.{name}",
                                     f"must be a positive integer, got {v!r}")
        if lo > hi:
            raise ParameterError("speculative_config.prompt_lookup_min",
                                 f"{lo} exceeds prompt_lookup_max {hi}")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_max=hi,
                   prompt_lookup_min=lo, model=model)
