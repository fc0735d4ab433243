"""Routes that describe the served model and its tokenizer: `GET /v1/models/{id}`,
`/tokenizer_info`, and `POST /tokenize` and `/detokenize`.

`/tokenizer_info` answers, as vLLM's behind `--enable-tokenizer-info-endpoint`, the tokenizer's
configuration as its tokenizer_config.json holds it (special tokens as plain strings) plus
`tokenizer_class` and the chat template in force; clients such as lm-eval's remote tokenizer
build their tokenizer from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    TokenizeRequest,
    TokenizeResponse,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_engine import HTTPError


def _json_value(value: Any) -> tuple[bool, Any]:
    """(representable, value as JSON): tokenizers' AddedToken objects become their text."""
    if value is None or isinstance(value, bool | int | float | str):
        return True, value
    if hasattr(value, "content") and isinstance(value.content, str):  # AddedToken
        return True, value.content
    if isinstance(value, list | tuple):
        items = [_json_value(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(value, dict):
        items = {str(k): _json_value(v) for k, v in value.items()}
        return all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    return False, None


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The tokenizer's init configuration as JSON, with its class and chat template."""
    info: dict[str, Any] = {}
    for key, value in dict(getattr(tokenizer, "init_kwargs", {})).items():
        ok, converted = _json_value(value)
        if ok:  # objects (a tokenizer_object, say) have no JSON form
            info[key] = converted
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            info.setdefault(name, str(token))
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = template
    return info


def add_info_routes(app: FastAPI, engine: AsyncLLM, check_model: Callable[[str], str],
                    chat_template: str | None, enable_tokenizer_info: bool) -> None:
    """Registers `GET /v1/models/{id}` and, if enabled, `GET /tokenizer_info` on `app`.

    `check_model` raises the API's 404 for a name the server does not serve.
    """

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> ModelCard:
        if not model_id:
            raise HTTPError(404, "The model `` does not exist.", "model")
        check_model(model_id)
        mc = engine.model_config
        return ModelCard(id=model_id, root=mc.model, max_model_len=mc.max_model_len)

    if not enable_tokenizer_info:
        return

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        tokenizer = engine.get_tokenizer()
        if tokenizer is None:
            raise HTTPError(400, "the server runs without a tokenizer")
        return tokenizer_info(tokenizer, chat_template)


def add_tokenizer_routes(app: FastAPI, engine: AsyncLLM, chat: OpenAIServingChat) -> None:
    """`POST /tokenize` (text, or messages through the chat template) and `/detokenize`."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        body.check_strings()
        chat.check_model(body.model)
        tok = chat.tokenizer
        if tok is None:
            raise HTTPError(400, "the server runs without a tokenizer", "prompt")
        if body.messages is not None:
            req = ChatCompletionRequest(messages=body.messages, chat_template=body.chat_template,
                                        add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message)
            text, _ = chat.render(req)
            ids = tok(text, add_special_tokens=bool(body.add_special_tokens)).input_ids
        elif body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok(body.prompt, add_special_tokens=add).input_ids
        else:
            raise HTTPError(400, "give either 'prompt' or 'messages'", "prompt")
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.model_config.max_model_len,
                                tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(body.model)
        tok = chat.tokenizer
        if tok is None:
            raise HTTPError(400, "the server runs without a tokenizer", "tokens")
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise HTTPError(400, f"token id {bad[0]} is outside [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=tok.decode(body.tokens))
