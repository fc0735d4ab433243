"""Structured-output constraints as llguidance grammars: building, validating, tokenizers.

A request's `StructuredOutputsParams` becomes one grammar string
(`grammar_key` -> `grammar_text`), compiled by llguidance against an
`LLTokenizer` of the model's vocabulary. The frontend validates the same
text (`validate`) so that a malformed schema, regex or grammar is a 400
naming its field before the request reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf

from jaxllm.errors import ParameterError
from jaxllm.sampling_params import StructuredOutputsParams

# Compact JSON: no whitespace between tokens (vLLM's disable_any_whitespace). A
# model free to emit whitespace can emit it forever, so it is the default here.
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec): what the compiled grammar depends on, hashable for the cache."""
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        spec = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    elif kind == "choice":
        spec = json.dumps(list(value))
    elif kind == "json_object":
        spec = ""
    else:
        spec = value
    return kind, spec


def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar for `grammar_key`'s (kind, spec); ParameterError on bad input."""
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = json.loads(spec)
            if not isinstance(schema, dict | bool):
                raise ParameterError(field, "a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 overrides=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            # Lark string literals take JSON's escapes, so any choice text is exact.
            alternatives = " | ".join(json.dumps(c) for c in json.loads(spec))
            return f"start: {alternatives}\n"
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(spec)
        if kind == "structural_tag":
            return _structural_tag_grammar(spec)
    except ParameterError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise ParameterError(field, f"invalid: {e}") from e
    raise ParameterError("structured_outputs", f"unknown kind {kind!r}")


def _structural_tag_grammar(spec: str) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    tag = json.loads(spec)
    triggers = tag.get("triggers") or []
    tags = []
    for s in tag["structures"]:
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"begin {s['begin']!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                         grammar=s.get("schema") or {}, end=s["end"]))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def check_grammar(tokenizer: llguidance.LLTokenizer, kind: str, text: str) -> None:
    """ParameterError naming the field when llguidance rejects the grammar."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if is_error:
        raise ParameterError(f"structured_outputs.{kind}", "; ".join(messages).strip()
                             or "invalid grammar")


def validate(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> None:
    """Builds and checks the request's grammar (the frontend's 400 before the engine)."""
    kind, spec = grammar_key(params)
    check_grammar(tokenizer, kind, grammar_text(kind, spec))


def make_tokenizer(hf_tokenizer: Any, vocab_size: int,
                   eos_token_id: int | None) -> llguidance.LLTokenizer:
    """An `LLTokenizer` over the model's `vocab_size` ids (the bitmask's width).

    Fast tokenizers with a byte-level or byte-fallback decoder go through
    llguidance's own reader; any other (e.g. a character-level vocabulary)
    is described token by token from what each id decodes to.
    """
    eos = eos_token_id if eos_token_id is not None else hf_tokenizer.eos_token_id
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    except (ValueError, TypeError):
        pass
    special = set(hf_tokenizer.all_special_ids)
    n = len(hf_tokenizer)
    tokens = []
    for i in range(vocab_size):
        if i >= n:
            tokens.append(b"")
        elif i in special:
            # llguidance marks special tokens by a leading 0xff byte.
            tokens.append(b"\xff" + hf_tokenizer.convert_ids_to_tokens(i).encode())
        else:
            tokens.append(hf_tokenizer.decode([i]).encode())

    class _Vocab:
        eos_token_id = eos
        bos_token_id = hf_tokenizer.bos_token_id
        special_token_ids = sorted(special)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            return hf_tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()))
