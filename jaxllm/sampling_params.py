"""Request-level sampling knobs, vLLM-compatible and validated on entry."""

from __future__ import annotations

import enum
import math
import numbers
import os
from collections.abc import Iterable
from typing import Any

import msgspec

from jaxllm.errors import ParameterError

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# The ranges the engine core's arrays hold: counts are int64, token ids and top_k
# int32 on the device, seeds uint64 (the children of an n > 1 request add their index).
INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1
SEED_LIMIT = 2**63
# Bad words the sampler's device tables hold per request, and tokens per word
# (sample/logits_processors.py, sample/output_state.py).
MAX_BAD_WORDS = 64
MAX_BAD_WORD_TOKENS = 16
# vLLM's VLLM_MAX_N_SEQUENCES: the most outputs one request may ask for.
DEFAULT_MAX_N_SEQUENCES = 16384
_FLOAT32_MAX = 3.4028234663852886e38
LOGIT_BIAS_LIMIT = 100.0


def max_n_sequences() -> int:
    """The bound on `n` (and `best_of`): $JAXLLM_MAX_N_SEQUENCES, else vLLM's default."""
    value = os.environ.get("JAXLLM_MAX_N_SEQUENCES")
    return int(value) if value else DEFAULT_MAX_N_SEQUENCES


def check_bad_words(words: list[list[int]]) -> None:
    """What the sampler's bad-words table holds (MAX_BAD_WORDS of MAX_BAD_WORD_TOKENS),
    else a ParameterError naming bad_words."""
    if len(words) > MAX_BAD_WORDS:
        raise ParameterError("bad_words", f"at most {MAX_BAD_WORDS} token sequences (each "
                             f"word counts with and without a leading space), got {len(words)}")
    for ids in words:
        if len(ids) > MAX_BAD_WORD_TOKENS:
            raise ParameterError("bad_words", f"a word may have at most {MAX_BAD_WORD_TOKENS} "
                                 f"tokens, got {len(ids)}")


def check_int(field: str, value: Any, low: int, high: int) -> None:
    """`value` is an integer in [low, high], else a ParameterError naming `field`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ParameterError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise ParameterError(field, f"must be at least {low}, got {value}")
    if value > high:
        raise ParameterError(field, f"must be at most {high}, got {value}")


def check_text(field: str, value: str) -> None:
    """`value` encodes as UTF-8 (a lone UTF-16 surrogate, from JSON's "\\ud800", does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParameterError(field, f"is not valid Unicode ({e.reason} at index {e.start})") \
            from None


def _check_texts(field: str, values: Iterable[Any]) -> None:
    for v in values:
        if not isinstance(v, str):
            raise ParameterError(field, f"must hold strings, got {v!r}")
        check_text(field, v)


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(
    msgspec.Struct, omit_defaults=True, kw_only=True
):  # type: ignore[call-arg]
    """vLLM's structured-output constraint: exactly one of the kinds below.

    `json` is a JSON schema (a dict or its text), `regex` a regular expression
    the whole output matches, `choice` a list of allowed outputs, `grammar` a
    Lark grammar (llguidance's dialect), `json_object` any JSON object, and
    `structural_tag` vLLM's structural tag (JSON text).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ParameterError("structured_outputs", "give exactly one of json, regex, choice, "
                                 f"grammar, json_object, structural_tag (got {kinds or 'none'})")
        for name in ("regex", "grammar", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ParameterError(f"structured_outputs.{name}", "must be a string")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ParameterError("structured_outputs.json", "must be a JSON schema (an object "
                                 "or its text)")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ParameterError("structured_outputs.choice", "must be a non-empty list of "
                                 "strings")

    def kinds(self) -> list[str]:
        return [k for k in ("json", "regex", "choice", "grammar", "json_object",
                            "structural_tag") if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


class SamplingParams(
    msgspec.Struct, omit_defaults=True, dict=True, kw_only=True
):  # type: ignore[call-arg]
    """Sampling parameters for one request (names and meanings follow vLLM)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the InputProcessor, never by users.
    all_stop_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError) as e:
                raise ParameterError("logit_bias", "must map token ids to numbers") from e
        if self.top_k is None or (isinstance(self.top_k, int) and self.top_k < 0):
            self.top_k = 0  # vLLM accepts -1 for "disabled"
        self.verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: other filters cannot change the arg-max.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def verify(self) -> None:
        """Every field within the range the engine holds; a ParameterError names the first
        that is not."""
        def bad(field: str, msg: str) -> None:
            raise ParameterError(field, msg)

        max_n = max_n_sequences()
        check_int("n", self.n, 1, max_n)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or abs(value) > _FLOAT32_MAX:
                bad(name, f"must be a finite number, got {value!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0 * 1e9:
            bad("repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        check_int("top_k", self.top_k, 0, TOKEN_ID_MAX)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, INT64_MAX)
        check_int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens",
                f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            check_int("seed", self.seed, 0, SEED_LIMIT - 1)
        _check_texts("stop", self.stop)
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if self.bad_words is not None:
            _check_texts("bad_words", self.bad_words)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty")
        for name in ("stop_token_ids", "allowed_token_ids", "all_stop_token_ids"):
            for tid in getattr(self, name) or ():
                check_int(name, tid, 0, TOKEN_ID_MAX)
        check_bad_words(self.bad_words_token_ids or [])
        for ids in self.bad_words_token_ids or ():
            for tid in ids:
                check_int("bad_words", tid, 0, TOKEN_ID_MAX)
        for tid, bias in (self.logit_bias or {}).items():
            check_int("logit_bias", tid, 0, TOKEN_ID_MAX)
            if not math.isfinite(bias) or abs(bias) > _FLOAT32_MAX:
                bad("logit_bias", f"the bias of token {tid} must be finite, got {bias}")

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks token ids against the model's vocabulary (known only to the engine)."""
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or ()),
                          ("logit_bias", (self.logit_bias or {}).keys())):
            for tid in ids:
                if not 0 <= tid < vocab_size:
                    raise ParameterError(name, f"token id {tid} is outside [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_token_mask(self) -> bool:
        """Logit bias, allowed/bad words or min_tokens need a per-vocab row."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
                    or self.min_tokens)

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


POOLING_TASKS = ("embed", "classify", "score")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """Knobs for `LLM.embed`/`encode`/`classify`/`score`, as vLLM's: `task` is what the
    pooled state becomes (None: the model's first pooling task; `LLM`'s methods set it).
    For "embed": `normalize` the pooled vector (None: as the model's pooling config says,
    L2-normalized unless a sentence-transformers checkpoint has no Normalize module);
    `dimensions` keeps the first that many (matryoshka models only). For a cross-encoder:
    `token_type_start` is where token type 1 begins (a BERT text pair's second text;
    None: every token is type 0), vLLM's compressed token type ids."""

    task: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    token_type_start: int | None = None
