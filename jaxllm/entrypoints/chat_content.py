"""A chat message's content as the chat template reads it: a string, or its text parts
joined; an image, audio or other part is refused, since jaxllm serves text only (a
multimodal checkpoint as its language model). Shared by `LLM.chat` and the server."""

from __future__ import annotations

from typing import Any

from jaxllm.errors import ParameterError


def content_text(field: str, content: Any) -> str:
    """`content` (None, a string, or a list of OpenAI content parts, dicts or objects
    with `type` and `text`) as one string; `field` names it in the error."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ParameterError(field, "must be a string or a list of content parts, got "
                             f"{type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, dict):
            kind, text = part.get("type"), part.get("text")
        else:
            kind, text = getattr(part, "type", None), getattr(part, "text", None)
        if kind != "text" or not isinstance(text, str):
            raise ParameterError(field, f"content part type {kind!r} is not supported "
                                 "(only 'text')")
        texts.append(text)
    return "".join(texts)


def text_messages(messages: list[dict[str, Any]], field: str = "messages"
                  ) -> list[dict[str, Any]]:
    """`messages` with every list of content parts joined into its text (`content_text`);
    an error names `{field}[i].content`."""
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and isinstance(msg.get("content"), list):
            msg = {**msg, "content": content_text(f"{field}[{i}].content", msg["content"])}
        out.append(msg)
    return out
