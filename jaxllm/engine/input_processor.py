"""Turns user prompts into EngineCoreRequests: tokenize, apply chat templates, validate,
and fan an n > 1 request out into its children (vLLM's parallel sampling)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import msgspec

from jaxllm.config import EngineConfig, ModelConfig
from jaxllm.core.messages import EngineCoreRequest
from jaxllm.errors import ParameterError
from jaxllm.lora.peft import check_lora_request
from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import (
    INT64_MAX,
    POOLING_TASKS,
    SEED_LIMIT,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    check_bad_words,
    check_int,
    check_text,
)

# vLLM's prompt forms: a string, {"prompt": str}, {"prompt_token_ids": [...]}.
PromptType = str | dict[str, Any] | list[int]


def load_tokenizer(model_config: ModelConfig) -> Any | None:
    if model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
    except Exception as e:
        raise ParameterError("tokenizer", f"cannot load a tokenizer from "
                             f"{model_config.tokenizer!r} ({e}); pass skip_tokenizer_init=True "
                             "to serve token ids only") from e
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = processor_chat_template(model_config.tokenizer)
    return tokenizer


def processor_chat_template(tokenizer_dir: str) -> str | None:
    """The chat template a multimodal checkpoint keeps for its processor only
    (`chat_template.json`), which vLLM falls back to when the tokenizer has none."""
    path = os.path.join(tokenizer_dir, "chat_template.json")
    try:
        with open(path) as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template else None


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """Per-child params of an n > 1 request: n = 1 each, seeds offset by the index
    (modulo the seed range, so that every child's seed stays valid)."""
    if params.n == 1:
        return [params]
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i) % SEED_LIMIT
        out.append(msgspec.structs.replace(params, n=1, seed=seed))
    return out


def child_request_id(index: int, request_id: str, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None,
                 max_request_tokens: int | None = None, config: EngineConfig | None = None):
        """`config`: the engine's, for the scheduling policy (a priority other than 0
        needs 'priority') and the LoRA settings a `lora_request` is checked against."""
        self.model_config = model_config
        self.priority_policy = (config is not None
                                and config.scheduler_config.policy == "priority")
        self.lora_config = config.lora_config if config is not None else None
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        # The most tokens one request can hold in the KV cache (set by the engine core).
        self.max_request_tokens = max_request_tokens or model_config.max_model_len
        self._ll_tokenizer: Any = None  # llguidance's view of the tokenizer, made on first use

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if isinstance(text, str):
                    check_text("prompt", text)
                return text, self._token_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ParameterError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return None, self._token_ids(prompt)
        if not isinstance(prompt, str):
            raise ParameterError("prompt", f"must be a string or token ids, got {type(prompt)}")
        check_text("prompt", prompt)
        if self.tokenizer is None:
            raise ParameterError("prompt", "text prompts need a tokenizer; with "
                                 "skip_tokenizer_init=True pass {'prompt_token_ids': [...]}")
        return prompt, self.tokenizer(prompt).input_ids

    @staticmethod
    def _token_ids(ids: Any) -> list[int]:
        try:
            return [int(t) for t in ids]
        except (TypeError, ValueError) as e:
            raise ParameterError("prompt_token_ids", f"must be a list of integers ({e})") from e

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.tokenizer is None:
            raise ParameterError("messages", "chat needs a tokenizer (skip_tokenizer_init=True)")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ParameterError("chat_template", "the tokenizer has no chat template; "
                                 "pass chat_template=")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:
            raise ParameterError("messages", f"chat template failed: {e}") from e
        check_text("messages", text)
        return text

    def requests(self, request_id: str, prompt: PromptType,
                 params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                 priority: int = 0, lora_request: LoRARequest | None = None
                 ) -> tuple[list[EngineCoreRequest], str | None, RequestOutputKind]:
        """The core requests of one user request (one, or n children of one sample
        each), its prompt text, and the kind of output its parent collects."""
        if priority != 0 and not self.priority_policy:
            raise ParameterError("priority", "needs scheduling_policy='priority'")
        first, text = self.process(request_id, prompt, params, arrival_time, priority)
        if lora_request is not None:
            check_lora_request(lora_request, self.lora_config)
            first = msgspec.structs.replace(first, lora_request=lora_request)
        if first.pooling_params is not None:  # an embedding: one request, one output
            return [first], text, RequestOutputKind.FINAL_ONLY
        child_params = fan_out(first.sampling_params)
        children = [msgspec.structs.replace(
            first, request_id=child_request_id(i, request_id, len(child_params)),
            sampling_params=p) for i, p in enumerate(child_params)]
        return children, text, first.sampling_params.output_kind

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        pooling = isinstance(params, PoolingParams)
        if pooling:
            params = self._pooling_task(params)
        self._check_task(params.task if pooling else "generate")
        text, ids = self.tokenize(prompt)
        self._validate_prompt(ids, pooling)
        if pooling:
            return EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                     pooling_params=self._pooling_params(params, len(ids)),
                                     arrival_time=arrival_time or time.time(),
                                     priority=priority), text
        check_int("priority", priority, -INT64_MAX, INT64_MAX)
        params = params.clone()
        params.verify_vocab(self.model_config.vocab_size)
        eos = self.model_config.eos_token_ids
        # The derived max_tokens comes first, so that min_tokens and the other checks
        # see the value the engine will use. A larger one stops at the context's end
        # anyway: capped here, so that the core's arrays only ever hold lengths that fit.
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            params.max_tokens = room
            params.min_tokens = min(params.min_tokens, room)
        # The set min_tokens masks: EOS stays in it under ignore_eos too (vLLM's
        # all_stop_token_ids; transformers' min_new_tokens), which only keeps EOS from stopping.
        params.all_stop_token_ids = sorted(set(params.stop_token_ids or ()) | set(eos))
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
            check_bad_words(params.bad_words_token_ids)
        if params.structured_outputs is not None:
            self._check_structured(params)
        if self.tokenizer is None or not params.detokenize:
            if params.stop:
                raise ParameterError("stop", "stop strings need detokenization "
                                     "(a tokenizer and detokenize=True)")
        params.verify()  # again, with the values filled in here
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                 sampling_params=params, eos_token_id=eos[0] if eos else None,
                                 arrival_time=arrival_time or time.time(),
                                 priority=priority), text

    def _supported_tasks(self) -> tuple[str, ...]:
        return getattr(self.model_config, "supported_tasks", ("generate", "embed"))

    def _pooling_task(self, params: PoolingParams) -> PoolingParams:
        """`params` with its task set: the model's first pooling task if none is named."""
        if params.task is not None:
            if params.task not in POOLING_TASKS:
                raise ParameterError("task", f"must be one of {POOLING_TASKS}, got "
                                     f"{params.task!r}")
            return params
        task = next((t for t in self._supported_tasks() if t in POOLING_TASKS), "embed")
        return msgspec.structs.replace(params, task=task)

    def _check_task(self, task: str) -> None:
        """A generate-only model asked to embed, an embed-only one asked to generate, or a
        model asked for a pooling task it does not serve."""
        tasks = self._supported_tasks()
        if task in tasks:
            return
        if "classify" in tasks:
            why = " (a score needs a single label: num_labels 1)" if task == "score" else ""
            raise ParameterError("task", f"this model is a cross-encoder: it serves "
                                 f"{' and '.join(tasks)}, not {task}{why}")
        if task == "embed":
            raise ParameterError("task", "this model does not support embeddings (it runs "
                                 "with runner='generate'); start it with runner='pooling'")
        if task != "generate":
            raise ParameterError("task", f"this model does not support {task}: only a "
                                 "cross-encoder (a sequence classifier) does")
        raise ParameterError("task", "this model does not support generation (it is a "
                             "pooling model: runner='pooling' or an encoder); use embed")

    def _pooling_params(self, params: PoolingParams, num_tokens: int) -> PoolingParams:
        """`params` with its normalization resolved and the task's own fields checked."""
        if params.task != "embed":
            for name in ("normalize", "dimensions"):
                if getattr(params, name) is not None:
                    raise ParameterError(name, f"applies to embeddings only, not to "
                                         f"{params.task}")
            if params.token_type_start is not None:
                check_int("token_type_start", params.token_type_start, 0, num_tokens)
                types = int(getattr(self.model_config.hf_config, "type_vocab_size", 1) or 1)
                if params.token_type_start < num_tokens and types < 2:
                    raise ParameterError("token_type_start", "this model has one token type "
                                         "(type_vocab_size 1)")
            return params
        if params.token_type_start is not None:
            raise ParameterError("token_type_start", "applies to a cross-encoder's text "
                                 "pairs only, not to embeddings")
        if params.dimensions is not None:
            hf = self.model_config.hf_config
            if not (getattr(hf, "is_matryoshka", False)
                    or getattr(hf, "matryoshka_dimensions", None)):
                raise ParameterError("dimensions", "this model does not support matryoshka "
                                     "representation; changing the output dimensions is "
                                     "not supported")
            check_int("dimensions", params.dimensions, 1, int(hf.hidden_size))
            allowed = getattr(hf, "matryoshka_dimensions", None)
            if allowed and params.dimensions not in allowed:
                raise ParameterError("dimensions", f"must be one of {list(allowed)}, got "
                                     f"{params.dimensions}")
        if params.normalize is None:
            params = msgspec.structs.replace(
                params, normalize=self.model_config.pooler_config.normalize)
        return params

    def _validate_prompt(self, ids: list[int], pooling: bool = False) -> None:
        if not ids:
            raise ParameterError("prompt", "the prompt is empty")
        if pooling:  # nothing is generated: the whole context may be prompt
            limit = min(self.max_model_len, self.max_request_tokens)
            if len(ids) > limit:
                raise ParameterError("prompt", f"the prompt has {len(ids)} tokens, more than "
                                     f"this model takes ({limit}: max_model_len "
                                     f"{self.max_model_len})")
        elif len(ids) >= self.max_model_len:
            raise ParameterError("prompt", f"the prompt has {len(ids)} tokens; max_model_len is "
                                 f"{self.max_model_len}, which leaves no room for output")
        elif len(ids) >= self.max_request_tokens:
            raise ParameterError("prompt", f"the prompt has {len(ids)} tokens but the KV cache "
                                 f"holds at most {self.max_request_tokens} for one request")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ParameterError("prompt_token_ids", f"token id {bad[0]} is outside [0, {vocab})")

    def _check_structured(self, params: SamplingParams) -> None:
        """A malformed schema, regex or grammar is the caller's error, named by its field."""
        from jaxllm.structured_output.grammar import make_tokenizer, validate

        if self.tokenizer is None:
            raise ParameterError("structured_outputs", "structured outputs need a tokenizer")
        if self._ll_tokenizer is None:
            eos = self.model_config.eos_token_ids
            self._ll_tokenizer = make_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                eos[0] if eos else None)
        validate(params.structured_outputs, self._ll_tokenizer)

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
