"""Turns user prompts into EngineCoreRequests: tokenize, apply chat templates, validate."""

from __future__ import annotations

import time
from typing import Any

from jaxllm.config import ModelConfig
from jaxllm.engine.messages import EngineCoreRequest
from jaxllm.errors import ParameterError
from jaxllm.sampling_params import PoolingParams, SamplingParams

# vLLM's prompt forms: a string, {"prompt": str}, {"prompt_token_ids": [...]}.
PromptType = str | dict[str, Any] | list[int]


def load_tokenizer(model_config: ModelConfig) -> Any | None:
    if model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_config.tokenizer)
    except Exception as e:
        raise ParameterError("tokenizer", f"cannot load a tokenizer from "
                             f"{model_config.tokenizer!r} ({e}); pass skip_tokenizer_init=True "
                             "to serve token ids only") from e


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None,
                 max_request_tokens: int | None = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        # The most tokens one request can hold in the KV cache (set by the engine core).
        self.max_request_tokens = max_request_tokens or model_config.max_model_len

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ParameterError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return None, [int(t) for t in prompt]
        if not isinstance(prompt, str):
            raise ParameterError("prompt", f"must be a string or token ids, got {type(prompt)}")
        if self.tokenizer is None:
            raise ParameterError("prompt", "text prompts need a tokenizer; with "
                                 "skip_tokenizer_init=True pass {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer(prompt).input_ids

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.tokenizer is None:
            raise ParameterError("messages", "chat needs a tokenizer (skip_tokenizer_init=True)")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ParameterError("chat_template", "the tokenizer has no chat template; "
                                 "pass chat_template=")
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:
            raise ParameterError("messages", f"chat template failed: {e}") from e

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        text, ids = self.tokenize(prompt)
        self._validate_prompt(ids)
        if isinstance(params, PoolingParams):
            return EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                     pooling_params=params,
                                     arrival_time=arrival_time or time.time(),
                                     priority=priority), text
        params = params.clone()
        params.verify_vocab(self.model_config.vocab_size)
        eos = self.model_config.eos_token_ids
        if params.max_tokens is None:
            params.max_tokens = max(self.max_model_len - len(ids), 1)
        # The set min_tokens masks: EOS stays in it under ignore_eos too (vLLM's
        # all_stop_token_ids; transformers' min_new_tokens), which only keeps EOS from stopping.
        params.all_stop_token_ids = sorted(set(params.stop_token_ids or ()) | set(eos))
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
        if self.tokenizer is None or not params.detokenize:
            if params.stop:
                raise ParameterError("stop", "stop strings need detokenization "
                                     "(a tokenizer and detokenize=True)")
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                 sampling_params=params, eos_token_id=eos[0] if eos else None,
                                 arrival_time=arrival_time or time.time(),
                                 priority=priority), text

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ParameterError("prompt", "the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ParameterError("prompt", f"the prompt has {len(ids)} tokens; max_model_len is "
                                 f"{self.max_model_len}, which leaves no room for output")
        if len(ids) >= self.max_request_tokens:
            raise ParameterError("prompt", f"the prompt has {len(ids)} tokens but the KV cache "
                                 f"holds at most {self.max_request_tokens} for one request")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ParameterError("prompt_token_ids", f"token id {bad[0]} is outside [0, {vocab})")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ParameterError("bad_words", "bad_words need a tokenizer")
        out: list[list[int]] = []
        for word in words:
            # A word may appear at the start of the text or after a space.
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer(variant, add_special_tokens=False).input_ids
                if ids and ids not in out:
                    out.append(ids)
        return out
