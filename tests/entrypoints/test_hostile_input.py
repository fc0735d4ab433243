"""Hostile request bodies against one real server: each gets a 400 naming its field (never
a 5xx, a hang or a dead engine), and an ordinary greedy request answers as before.

One server for the module; the property-based fuzz runs last.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer, engine_core_pid
from tests.models.tiny_checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.slow

API_KEY = "hostile-key"
MAX_MODEL_LEN = 256
MAX_N = 8
TIMEOUT_S = 60.0  # no answer within this is a hang
GREEDY = {"model": "tiny", "prompt": "The answer is", "max_tokens": 12, "temperature": 0.0,
          "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama")
    srv = RemoteServer([model, *TINY_ENGINE_FLAGS, "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-num-seqs", "8", "--request-buckets", "8",
                        "--served-model-name", "tiny", "--api-key", API_KEY,
                        "--max-n-sequences", str(MAX_N), "--disable-log-stats"])
    srv.baseline = greedy_answer(srv)
    yield srv
    srv.stop()


def post(server, path: str, body: dict | str, key: str | None = API_KEY,
         auth: str | None = None) -> httpx.Response:
    """Sends `body` as JSON text: lone surrogates go as "\\ud800" escapes, NaN as NaN."""
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    elif key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, content=content, headers=headers, timeout=TIMEOUT_S)


def greedy_answer(server) -> list[int]:
    r = post(server, "/v1/completions", {**GREEDY, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def assert_unharmed(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert greedy_answer(server) == server.baseline


def assert_400(r: httpx.Response, param: str, *fragments: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, 2**70])
@pytest.mark.parametrize("path,field", [("/v1/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_completion_tokens")])
def test_max_tokens_beyond_int64_is_a_400_and_the_engine_lives(server, path, field, value):
    body = {**(GREEDY if path == "/v1/completions" else CHAT), field: value}
    assert_400(post(server, path, body), field)
    assert_unharmed(server)


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, 2**70, -1])
def test_an_out_of_range_stop_token_id_is_a_400(server, value):
    assert_400(post(server, "/v1/completions", {**GREEDY, "stop_token_ids": [value]}),
               "stop_token_ids")
    assert_unharmed(server)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", ["unset", None])
def test_min_tokens_above_the_derived_max_tokens_is_a_400_not_a_hang(server, stream,
                                                                    max_tokens):
    body = {**CHAT, "min_tokens": MAX_MODEL_LEN + 10, "stream": stream}
    if max_tokens != "unset":
        body["max_tokens"] = max_tokens
    t0 = time.monotonic()
    assert_400(post(server, "/v1/chat/completions", body), "min_tokens", "max_tokens=")
    assert time.monotonic() - t0 < 10
    assert_unharmed(server)


@pytest.mark.parametrize("body,param", [
    ({**GREEDY, "n": MAX_N + 1}, "n"),
    ({**GREEDY, "n": 10**9}, "n"),
    ({**GREEDY, "n": 2**70}, "n"),
    ({**GREEDY, "best_of": 10**9}, "best_of"),
    ({**CHAT, "n": 10**9, "stream": True}, "n"),
])
def test_n_and_best_of_are_bounded_by_max_n_sequences(server, body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    assert_400(post(server, path, body), param)
    assert_unharmed(server)


def test_n_at_the_bound_is_served(server):
    r = post(server, "/v1/completions", {**GREEDY, "n": MAX_N, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == MAX_N


SURROGATE = "\\ud800"  # the JSON escape of a lone UTF-16 surrogate


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", f'{{"model": "tiny", "prompt": "a{SURROGATE}b"}}', "prompt"),
    ("/v1/completions", f'{{"model": "tiny", "prompt": ["ok", "{SURROGATE}"]}}', "prompt[1]"),
    ("/v1/completions", f'{{"model": "tiny", "prompt": "hi", "stop": ["{SURROGATE}"]}}',
     "stop[0]"),
    ("/v1/completions", f'{{"model": "{SURROGATE}", "prompt": "hi"}}', "model"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     "messages[0].content"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], '
     f'"stop": "{SURROGATE}"}}', "stop"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], '
     f'"chat_template_kwargs": {{"x": "{SURROGATE}"}}}}', "chat_template_kwargs.x"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     "messages[0].content"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(server, path, raw, param):
    assert_400(post(server, path, raw), param, "not valid Unicode")
    assert_unharmed(server)


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {**GREEDY, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**6},
     "max_completion_tokens"),
])
def test_max_tokens_past_the_context_is_a_400_naming_the_limit(server, path, body, field):
    assert_400(post(server, path, body), field,
               f"maximum context length is {MAX_MODEL_LEN} tokens")


@pytest.mark.parametrize("raw,param", [
    ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature"),
    ('{"model": "tiny", "prompt": "hi", "top_p": NaN}', "top_p"),
    ('{"model": "tiny", "prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
    ('{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ('{"model": "tiny", "prompt": "hi", "top_k": 1180591620717411303424}', "top_k"),
    ('{"model": "tiny", "prompt": [1180591620717411303424]}', "prompt_token_ids"),
    ('{"model": "tiny", "prompt": "hi", "logit_bias": {"99999999999999999999999": 1}}',
     "logit_bias"),
])
def test_non_finite_and_huge_numbers_are_400s(server, raw, param):
    assert_400(post(server, "/v1/completions", raw), param)
    assert_unharmed(server)


def test_the_bearer_scheme_is_matched_in_any_case_and_wrong_keys_are_refused(server):
    body = {**GREEDY, "max_tokens": 1}
    for auth in (f"bearer {API_KEY}", f"BEARER {API_KEY}", f"Bearer  {API_KEY}"):
        assert post(server, "/v1/completions", body, auth=auth).status_code == 200, auth
    for auth in (f"Bearer {API_KEY}x", f"Basic {API_KEY}", API_KEY, "Bearer", ""):
        assert post(server, "/v1/completions", body, auth=auth).status_code == 401, auth


# ------------------------------------------------------------------ property-based fuzz

HOSTILE_INTS = st.sampled_from([-(2**70), -(2**63) - 1, -1, 0, 1, 2, 3, 2**31, 2**63 - 1,
                                2**63, 2**64 - 1, 2**64, 2**70])
HOSTILE_FLOATS = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1e300, -2.5,
                                  0.0, 0.5, 1.0, 2.5, 1e300])
HOSTILE_TEXT = st.sampled_from(["", "hi", "\ud800", "a\udfffb", "\x00", "<s>", "é" * 40])
SCALARS = st.one_of(st.none(), st.booleans(), HOSTILE_INTS, HOSTILE_FLOATS, HOSTILE_TEXT)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4),
                   st.lists(st.lists(HOSTILE_INTS, max_size=3), max_size=2),
                   st.dictionaries(HOSTILE_TEXT, SCALARS, max_size=3))
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "n",
          "best_of", "seed", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
          "min_p", "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias",
          "allowed_token_ids", "bad_words", "priority", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "stream", "echo", "model",
          "chat_template_kwargs", "add_special_tokens", "ignore_eos", "return_token_ids"]
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": st.one_of(HOSTILE_TEXT, SCALARS)}),
                    max_size=3)


@st.composite
def hostile_bodies(draw):
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
    if draw(st.integers(0, 3)) == 0:
        # A servable body with at most one hostile field. Bodies of several hostile
        # fields are nearly all refused, and the served path must be fuzzed too.
        chat = path == "/v1/chat/completions"
        body = ({"messages": [{"role": "user", "content": "hi"}]} if chat
                else {"prompt": "hi"})
        body["max_tokens"] = 2
        if draw(st.booleans()):
            body[draw(st.sampled_from(FIELDS))] = draw(VALUES)
        return path, body
    body = draw(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6))
    if path == "/v1/chat/completions" and draw(st.booleans()):
        body["messages"] = draw(MESSAGES)
    elif path != "/v1/chat/completions" and draw(st.booleans()):
        body["prompt"] = draw(st.one_of(HOSTILE_TEXT, st.lists(HOSTILE_INTS, max_size=4)))
    # Keep the generation short so that the accepted bodies finish quickly.
    if "max_tokens" not in body and draw(st.booleans()):
        body["max_tokens"] = 2
    if "max_tokens" not in body and path == "/v1/chat/completions":
        body["max_tokens"] = draw(st.sampled_from([2, None]))
    return path, body


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


_STATUSES: list[int] = []


@settings(max_examples=int(os.environ.get("JAXLLM_FUZZ_EXAMPLES", "100")), deadline=None,
          database=None, suppress_health_check=list(HealthCheck))
@given(case=hostile_bodies())
def _fuzz_one(server, case):
    path, body = case
    t0 = time.monotonic()
    r = post(server, path, body)  # httpx raises on a hang past TIMEOUT_S
    assert r.status_code < 500, (path, body, r.status_code, r.text)
    _STATUSES.append(r.status_code)
    assert time.monotonic() - t0 < TIMEOUT_S
    if r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code


def test_fuzzed_hostile_bodies_never_give_a_5xx_hang_or_a_changed_answer(server):
    """Runs last. Hypothesis draws bodies of hostile values for every sampling field."""
    pids = [server.proc.pid, server.engine_pid]
    _fuzz_one(server)  # warm-up allocations happen here too
    rss_before = [_rss_kib(p) for p in pids]
    _fuzz_one(server)
    rss_after = [_rss_kib(p) for p in pids]
    # Both outcomes were exercised: bodies the engine served and bodies refused.
    assert _STATUSES.count(200) >= 5 and _STATUSES.count(400) >= 5, sorted(_STATUSES)
    print("statuses:", {c: _STATUSES.count(c) for c in set(_STATUSES)})
    assert_unharmed(server)
    assert engine_core_pid(server.proc.pid) == pids[1] and server.proc.poll() is None
    # The second batch repeats the first one's kinds of input: memory has settled.
    for before, after in zip(rss_before, rss_after, strict=True):
        assert after - before < 64 * 1024, (rss_before, rss_after)
