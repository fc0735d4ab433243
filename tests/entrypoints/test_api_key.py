"""The API-key check: the 'Bearer' scheme in any case, the key compared in constant time,
on every route that computes."""

from __future__ import annotations

import asyncio
import hmac

import pytest

from jaxllm.entrypoints.openai.api_server import GuardMiddleware


@pytest.fixture
def guard() -> GuardMiddleware:
    return GuardMiddleware(app=None, api_key="s3cret", max_bytes=1024)


@pytest.mark.parametrize("header", [b"Bearer s3cret", b"bearer s3cret", b"BEARER  s3cret",
                                    b" Bearer s3cret "])
def test_the_right_key_passes_whatever_the_schemes_case(guard, header):
    assert guard._authorized(header)


@pytest.mark.parametrize("header", [b"", b"Bearer", b"Bearer s3cre", b"Bearer s3cretx",
                                    b"Basic s3cret", b"s3cret", b"Bearer \xff"])
def test_wrong_or_malformed_keys_are_refused(guard, header):
    assert not guard._authorized(header)


def test_the_key_is_compared_with_a_constant_time_function(guard, monkeypatch):
    calls = []
    compare = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr("jaxllm.entrypoints.openai.api_server.hmac.compare_digest", spy)
    assert guard._authorized(b"Bearer s3cret")
    assert not guard._authorized(b"Bearer nope")
    assert calls == [(b"s3cret", b"s3cret"), (b"nope", b"s3cret")]


@pytest.mark.parametrize("path,protected", [
    ("/v1/completions", True), ("/v1/embeddings", True), ("/score", True), ("/v1/score", True),
    ("/rerank", True), ("/v1/rerank", True), ("/v2/rerank", True), ("/health", False),
    ("/metrics", False), ("/version", False), ("/tokenize", False), ("/detokenize", False),
    ("/tokenizer_info", False)])
def test_every_route_that_computes_needs_the_key(guard, path, protected):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard.app = app
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    asyncio.run(guard(scope, receive, send))
    assert sent[0]["status"] == (401 if protected else 200)
