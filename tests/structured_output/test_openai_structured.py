"""Structured outputs over HTTP with the official openai client, streaming and not.

OpenAI's `response_format` (json_object, json_schema) on chat and completions,
vLLM's `structured_outputs` in the body (json, regex, choice), and a malformed
constraint as a 400 naming its field. One server serves the module.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.structured_output.schemas import validate

# A server start (and its precompile) takes well over 10 s on a small CPU.
pytestmark = pytest.mark.slow

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 4},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 0, "maxItems": 2}},
    "required": ["age", "name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                 max_position_embeddings=512)
    srv = RemoteServer([model, *TINY_ENGINE_FLAGS, "--max-model-len", "512",
                        "--max-num-seqs", "4", "--request-buckets", "4",
                        "--served-model-name", MODEL])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, stream: bool, **kw) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion, streamed or not."""
    messages = [{"role": "user", "content": "Give me JSON"}]
    if not stream:
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                              temperature=0, **kw)
        return resp.choices[0].message.content, resp.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                                temperature=0, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_output_parses_and_validates(client, stream):
    text, finish = _chat(client, stream, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                               "strict": True}})
    assert finish == "stop"
    validate(SCHEMA, json.loads(text))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_object_output_is_a_json_object(client, stream):
    text, finish = _chat(client, stream, response_format={"type": "json_object"},
                         extra_body={"seed": 3})
    if finish == "stop":  # an open-ended object may run past max_tokens
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_structured_outputs_regex_and_choice(client, stream):
    for body, check in (({"regex": "[a-z]{2}-[0-9]{3}"},
                         lambda t: re.fullmatch("[a-z]{2}-[0-9]{3}", t)),
                        ({"choice": ["red", "green", "blue"]},
                         lambda t: t in ("red", "green", "blue"))):
        kw = dict(model=MODEL, prompt="Pick:", max_tokens=50, temperature=0,
                  extra_body={"structured_outputs": body})
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            text = client.completions.create(**kw).choices[0].text
        assert check(text), (body, text)


def test_completions_response_format_json_schema(client):
    resp = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=0,
                                     extra_body={"response_format": {
                                         "type": "json_schema",
                                         "json_schema": {"name": "p", "schema": SCHEMA}}})
    validate(SCHEMA, json.loads(resp.choices[0].text))


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "no-schema"}}),
     "response_format.json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs.regex"),
    (dict(extra_body={"structured_outputs": {"json": {"type": 3}}}), "structured_outputs.json"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
     "structured_outputs"),
])
def test_a_malformed_constraint_is_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, False, **kw)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
