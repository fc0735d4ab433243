"""The API-key check: the 'Bearer' scheme in any case, the key compared in constant time."""

from __future__ import annotations

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
