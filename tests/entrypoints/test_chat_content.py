"""Chat content parts: text parts join into the message's text; an image or audio part is
a ParameterError naming `messages[i].content` (the server's 400 and LLM.chat alike; the
offline path against an engine: tests/engine/test_multimodal_text_engine.py)."""

from __future__ import annotations

import pytest

from jaxllm.entrypoints.chat_content import text_messages
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.errors import ParameterError

PARTS = [{"type": "text", "text": "count "}, {"type": "text", "text": "to 3"}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_text_parts_join_the_same_in_the_request_body_and_offline():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PARTS}]
    body = ChatCompletionRequest(model="m", messages=messages).messages_as_dicts()
    assert [m["content"] for m in body] == ["be brief", "count to 3"]
    assert text_messages(messages) == body


@pytest.mark.parametrize("part", [IMAGE, {"type": "input_audio", "input_audio": {}},
                                  {"type": "text"}])
def test_a_part_other_than_text_is_refused_naming_the_message(part):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [PARTS[0], part]}]
    with pytest.raises(ParameterError, match=r"^messages\[1\]\.content: content part type") as e:
        ChatCompletionRequest(model="m", messages=messages).messages_as_dicts()
    assert e.value.field == "messages[1].content"
    with pytest.raises(ParameterError) as e:
        text_messages(messages)
    assert e.value.field == "messages[1].content"
