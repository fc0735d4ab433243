"""The OpenAI-compatible server, through a real uvicorn and the official openai client.

One server for the whole module (compilation is the slow part); the SIGTERM
test stops it and therefore runs last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer, pid_alive
from tests.models.tiny_checkpoints import make_tiny_checkpoint

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 2048
# Tokens: long enough that a request is still running when the client leaves. A
# decode step of the tiny model takes the CPU ~0.5 ms: 480 tokens once finished
# inside the 0.3 s client timeout below.
LONG = 2000
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


pytestmark = pytest.mark.slow  # a server for the module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                 max_position_embeddings=MAX_MODEL_LEN)
    srv = RemoteServer([model, *TINY_ENGINE_FLAGS, "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-num-seqs", "16", "--request-buckets", "4,16",
                        "--api-key", API_KEY, "--served-model-name", MODEL,
                        "--max-request-bytes", "65536", "--log-stats-interval", "1"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                              timeout=120)


def post(server, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)
    return httpx.post(server.url + path, content=body, headers={
        **headers, "Content-Type": "application/json"}, timeout=60, **kw)


def wait_idle(server, timeout: float = 15.0) -> dict[str, float]:
    """Metrics once no request runs and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["jaxllm:num_requests_running"] == 0 and m["jaxllm:num_requests_waiting"] == 0
                and m["jaxllm:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, f"engine not idle: {m}"
        time.sleep(0.1)


def test_models_health_and_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_stream_and_non_stream_give_the_same_text(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, **GREEDY)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == ["length"] == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage == full.usage


def test_chat_stream_and_non_stream_give_the_same_text_async(server):
    async def run():
        aclient = async_client(server)
        msgs = [{"role": "user", "content": "Say something"}]
        full = await aclient.chat.completions.create(model=MODEL, messages=msgs,
                                                     max_completion_tokens=10, **GREEDY)
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=msgs, max_completion_tokens=10, stream=True,
            stream_options={"include_usage": True}, **GREEDY)
        chunks = [c async for c in stream]
        return full, chunks

    full, chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert full.usage.completion_tokens == 10 and chunks[-1].usage == full.usage


def test_sync_chat_and_max_tokens_names(client):
    msgs = [{"role": "user", "content": "hi"}]
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **GREEDY)
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3,
                                       **GREEDY)
    assert a.usage.completion_tokens == 4 and b.usage.completion_tokens == 3
    assert a.choices[0].message.content.startswith(b.choices[0].message.content)
    assert a.choices[0].finish_reason == "length"


def test_64_concurrent_streams_deliver_every_token_once_and_in_order(server):
    prompts = [f"request {i}: tell me {'ab' * (i % 5)}" for i in range(64)]
    extra = {"ignore_eos": True, "return_token_ids": True}

    async def one(aclient, prompt):
        ref = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                               temperature=0.0, extra_body=extra)
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                  temperature=0.0, extra_body=extra,
                                                  stream=True)
        ids, text = [], ""
        async for chunk in stream:
            for choice in chunk.choices:
                ids += choice.token_ids
                text += choice.text
        return ref.choices[0], ids, text

    async def run():
        aclient = async_client(server)
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    for ref, ids, text in asyncio.run(run()):
        assert len(ids) == 16
        assert ids == ref.token_ids and text == ref.text


def test_n_seed_logprobs_and_stop(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=8, n=2, temperature=0.9, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded

    lp = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, logprobs=2,
                                   **GREEDY).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values()) for i in range(5))

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
        top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)

    text = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=12,
                                     **GREEDY).choices[0].text
    stop = text[4:6]
    stopped = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=12,
                                        stop=[stop], **GREEDY).choices[0]
    assert stopped.text == text[:text.find(stop)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop


def test_all_sampling_knobs_are_accepted(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2})
    assert out.usage.completion_tokens >= 2


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": "many"}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN + 100)}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt_token_ids"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "frequency_penalty": 9}, "frequency_penalty"),
])
def test_bad_parameters_answer_400_naming_the_field(server, path, body, param):
    r = post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and param in err["message"]


def test_bad_json_is_400_and_the_openai_client_raises_bad_request(server, client):
    r = post(server, "/v1/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-2)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"


def test_wrong_or_missing_api_key_is_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401


def test_body_over_the_size_limit_is_413(server):
    body = json.dumps({"model": MODEL, "prompt": "x" * 100_000})
    assert post(server, "/v1/completions", body).status_code == 413

    def chunked():  # no Content-Length: counted while it is read
        yield body[:50_000].encode()
        yield body[50_000:].encode()

    r = post(server, "/v1/completions", chunked())
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_tokenize_and_detokenize_round_trip(server):
    tok = post(server, "/tokenize", {"model": MODEL, "prompt": "hello"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    text = post(server, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}).json()
    assert text["prompt"].endswith("hello")
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tok["count"]


def test_prompt_logprobs_come_back_on_each_choice_without_echo(server, client):
    prompt = "Once upon"
    ids = post(server, "/tokenize", {"model": MODEL, "prompt": prompt}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0,
                                    extra_body={"prompt_logprobs": 2})
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      temperature=0.0)
    assert "prompt_logprobs" not in plain.choices[0].to_dict()
    body = out.choices[0].to_dict()["prompt_logprobs"]
    # vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}}.
    assert len(body) == len(ids) == out.usage.prompt_tokens and body[0] is None
    for tid, entry in zip(ids[1:], body[1:], strict=True):
        ranks = {int(t): lp["rank"] for t, lp in entry.items()}
        assert tid in ranks and {1, 2} <= set(ranks.values()) and len(entry) <= 3
        assert all(lp["logprob"] <= 0 and isinstance(lp["decoded_token"], str)
                   for lp in entry.values())

    # With echo the legacy logprobs carry the same prompt values; prompt_logprobs keeps its k.
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                       logprobs=3, temperature=0.0,
                                       extra_body={"prompt_logprobs": 1}).choices[0]
    trimmed = echoed.to_dict()["prompt_logprobs"]
    assert all(len(e) <= 2 for e in trimmed[1:])
    assert echoed.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        [e[str(t)]["logprob"] for t, e in zip(ids[1:], trimmed[1:], strict=True)])
    assert max(len(top) for top in echoed.logprobs.top_logprobs[1:len(ids)]) >= 3

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        temperature=0.0, extra_body={"prompt_logprobs": 0})
    body = chat.to_dict()["prompt_logprobs"]
    assert len(body) == chat.usage.prompt_tokens and body[0] is None
    assert all(len(e) == 1 for e in body[1:])


def test_add_special_tokens_decides_whether_a_bos_is_prepended(server, client):
    prompt = "hello"

    def tokens(add: bool) -> int:
        r = post(server, "/tokenize", {"model": MODEL, "prompt": prompt,
                                       "add_special_tokens": add})
        return r.json()["count"]

    def completion_tokens(**extra) -> int:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                         extra_body=extra).usage.prompt_tokens

    assert tokens(True) == tokens(False) + 1  # the tiny tokenizer prepends <s>
    assert completion_tokens() == completion_tokens(add_special_tokens=True) == tokens(True)
    assert completion_tokens(add_special_tokens=False) == tokens(False)
    # Chat templates write their own BOS; as in vLLM, chat adds none unless asked.
    msgs = [{"role": "user", "content": prompt}]
    chat = [client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                           extra_body=extra).usage.prompt_tokens
            for extra in ({}, {"add_special_tokens": True})]
    assert chat[1] == chat[0] + 1


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": LONG, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        during = server.metrics()
    # Leaving the `with` closed the connection mid-stream.
    after = wait_idle(server)
    assert during["jaxllm:num_requests_running"] == 1
    assert during["jaxllm:kv_cache_usage_perc"] > 0
    generated = after["jaxllm:generation_tokens_total"] - before["jaxllm:generation_tokens_total"]
    assert generated < LONG
    assert after.get("jaxllm:request_success_total[length]") == \
        before.get("jaxllm:request_success_total[length]")


def test_client_timeout_on_a_plain_request_aborts_it(server):
    before = wait_idle(server)
    impatient = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                              timeout=0.15)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt="go on", max_tokens=LONG,
                                     **GREEDY)
    after = wait_idle(server)
    generated = after["jaxllm:generation_tokens_total"] - before["jaxllm:generation_tokens_total"]
    assert generated < LONG


def test_metrics_and_the_periodic_stat_line(server, client):
    # Traffic of its own, so that the test also holds when run alone.
    client.completions.create(model=MODEL, prompt="Once upon a", max_tokens=4)
    m = server.metrics()
    for name in ("jaxllm:prompt_tokens_total", "jaxllm:generation_tokens_total",
                 "jaxllm:time_to_first_token_seconds_count",
                 "jaxllm:time_per_output_token_seconds_count",
                 "jaxllm:e2e_request_latency_seconds_count"):
        assert m[name] > 0, name
    for name in ("jaxllm:prefix_cache_hit_rate", "jaxllm:num_preemptions_total",
                 "jaxllm:prefix_cache_queries_total"):
        assert name in m
    deadline = time.monotonic() + 15  # the stat line comes every log-stats-interval
    while "Avg generation throughput" not in (logs := server.logs(200_000)):
        assert time.monotonic() < deadline, "no periodic stat line"
        time.sleep(0.2)
    assert "KV cache usage" in logs


def test_streamed_n2_completions_reassemble_per_index_into_the_non_streamed_texts(client):
    # Two prompts x n=2: choice index is prompt * n + sample, in both modes.
    kw = dict(model=MODEL, prompt=["Once upon a", "The quick"], max_tokens=10, n=2,
              temperature=0.9, seed=11, extra_body={"ignore_eos": True,
                                                     "return_token_ids": True})
    full = client.completions.create(**kw)
    texts, ids, finish = {}, {}, {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids[c.index] = ids.get(c.index, []) + (c.token_ids or [])
            if c.finish_reason:
                assert c.index not in finish  # one final chunk per choice
                finish[c.index] = c.finish_reason
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert texts == {c.index: c.text for c in full.choices}
    assert ids == {c.index: c.token_ids for c in full.choices}
    assert all(len(t) == 10 for t in ids.values())
    assert finish == {i: "length" for i in range(4)}
    assert ids[0] != ids[1] and ids[2] != ids[3]  # the samples of one prompt differ


def test_streamed_chat_n2_reassembles_per_index_into_the_non_streamed_messages(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=8,
              n=2, temperature=0.9, seed=5, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    texts, roles = {}, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in full.choices}
    assert texts[0] != texts[1]


def test_streamed_chat_logprobs_equal_the_non_streamed_ones(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}],
              max_tokens=9, logprobs=True, top_logprobs=2, **GREEDY)
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs else []
    assert len(full) == len(streamed) == 9
    for a, b in zip(full, streamed, strict=True):
        assert (a.token, a.bytes) == (b.token, b.bytes)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert [t.logprob for t in a.top_logprobs] == pytest.approx(
            [t.logprob for t in b.top_logprobs], abs=1e-5)
        assert len(b.top_logprobs) == 2
        assert b.logprob == pytest.approx(b.top_logprobs[0].logprob, abs=1e-5)  # greedy


def _rise(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_metrics_count_prefix_hits_tokens_and_requests_of_a_repeated_prompt(server, client):
    block_size = int(TINY_ENGINE_FLAGS[TINY_ENGINE_FLAGS.index("--block-size") + 1])
    # Token ids no other test sends, so the first request finds nothing cached.
    ids = [8 + (i * 37 + 11) % 240 for i in range(101)]
    kw = dict(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    hit_tokens = (len(ids) - 1) // block_size * block_size  # the last token is always computed
    m0 = wait_idle(server)
    first = client.completions.create(**kw)
    m1 = wait_idle(server)
    second = client.completions.create(**kw)
    m2 = wait_idle(server)
    assert first.choices[0].text == second.choices[0].text
    for before, after, out, hits in ((m0, m1, first, 0), (m1, m2, second, hit_tokens)):
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 5
        assert _rise(before, after, "jaxllm:prefix_cache_queries_total") == len(ids)
        assert _rise(before, after, "jaxllm:prefix_cache_hits_total") == hits
        # The whole prompt of every request, prefix-cache hits included (as vLLM).
        assert _rise(before, after, "jaxllm:prompt_tokens_total") == out.usage.prompt_tokens
        assert _rise(before, after, "jaxllm:generation_tokens_total") == \
            out.usage.completion_tokens
        for name in ("jaxllm:request_success_total[length]",
                     "jaxllm:time_to_first_token_seconds_count",
                     "jaxllm:time_per_output_token_seconds_count",
                     "jaxllm:e2e_request_latency_seconds_count"):
            assert _rise(before, after, name) == 1, name
        assert _rise(before, after, "jaxllm:num_preemptions_total") == 0
    assert m2["jaxllm:prefix_cache_hit_rate"] == pytest.approx(
        m2["jaxllm:prefix_cache_hits_total"] / m2["jaxllm:prefix_cache_queries_total"])


def test_decoder_embeddings_over_http_are_the_normalized_last_hidden_state(client, server):
    import numpy as np
    import torch
    from transformers import AutoModel

    prompts = [[5, 6, 7, 8], [9, 10]]
    resp = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    assert resp.usage.prompt_tokens == 6
    # The model directory: /v1/models' root.
    root = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=30).json()["data"][0]["root"]
    hf = AutoModel.from_pretrained(root, dtype=torch.float32)
    for d, p in zip(resp.data, prompts, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(d.embedding, ref / np.linalg.norm(ref), atol=1e-4)


def test_sigterm_finishes_in_flight_requests_and_leaves_no_process(server, client):
    # Runs last: it stops the module's server.
    result = {}
    started = threading.Event()

    def stream():
        ids = []
        for chunk in client.completions.create(model=MODEL, prompt="finish me", max_tokens=200,
                                               stream=True, temperature=0.0,
                                               extra_body={"ignore_eos": True,
                                                           "return_token_ids": True}):
            ids += chunk.choices[0].token_ids
            started.set()
        result["ids"] = ids

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert len(result["ids"]) == 200
    assert server.proc.wait(30) == 0
    assert server.engine_pid is not None and not pid_alive(server.engine_pid)
