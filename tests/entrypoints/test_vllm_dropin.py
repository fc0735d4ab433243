"""vLLM drop-in behaviour of `jaxllm serve`, through the official openai client and raw HTTP.

What harnesses and dashboards written for vLLM rely on: echo with max_tokens=0 (prompt
loglikelihoods), `GET /v1/models/{id}`, `/tokenizer_info`, the `vllm:*` Prometheus metrics,
and min_tokens holding EOS back even under ignore_eos. One demo-model server for the module.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.config import default_model_path
from jaxllm.entrypoints.openai.serving_info import add_info_routes
from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer

MODEL = "demo"
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "server-demo.yaml")
PROMPT = "reverse hello"

pytestmark = pytest.mark.slow  # a server start compiles the demo model's buckets


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--config", CONFIG, *TINY_ENGINE_FLAGS, "--max-num-seqs", "4",
                        "--request-buckets", "4", "--enable-tokenizer-info-endpoint",
                        "--log-stats-interval", "60"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


# ----------------------------------------------------------------- 1. echo with max_tokens=0


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only(client, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0.0)
    choice = r.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    assert "".join(lp.tokens) == PROMPT  # <s> decodes to nothing, as in the text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0.0 for v in lp.token_logprobs[1:])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    # The same numbers as the prompt_logprobs of a request that does generate.
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0,
                                    extra_body={"prompt_logprobs": 1}).to_dict()
    plp = ref["choices"][0]["prompt_logprobs"]
    want = [plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)


def test_echo_with_max_tokens_0_over_raw_http_batched_and_streamed(server, tokenizer):
    prompts = [PROMPT, "count 7 8 9"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 0}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["text"] for c in out["choices"]] == prompts
    for c, p in zip(out["choices"], prompts, strict=True):
        assert len(c["logprobs"]["token_logprobs"]) == len(tokenizer(p).input_ids)
        assert c["logprobs"]["token_logprobs"][0] is None
    assert out["usage"]["completion_tokens"] == 0
    # Token ids, as lm-eval sends them: the echo is the decoded prompt, the logprobs the same.
    ids = tokenizer(PROMPT).input_ids
    by_ids = post(server, "/v1/completions", {**body, "prompt": ids}).json()["choices"][0]
    assert by_ids["text"] == PROMPT
    by_text = out["choices"][0]["logprobs"]
    for key in ("tokens", "text_offset"):
        assert by_ids["logprobs"][key] == by_text[key], key
    # Batched with another prompt or alone: another step shape, float32 rounding apart.
    assert by_ids["logprobs"]["token_logprobs"][0] is None
    assert by_ids["logprobs"]["token_logprobs"][1:] == pytest.approx(
        by_text["token_logprobs"][1:], abs=1e-4)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={**body, "prompt": PROMPT, "stream": True}) as s:
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_0_without_echo_is_a_400_naming_max_tokens(server, client):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


# ----------------------------------------------------------------- 2. GET /v1/models/{id}


def test_get_model_by_id_returns_its_card_and_404s_an_unknown_one(server, client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    raw = httpx.get(server.url + f"/v1/models/{MODEL}", timeout=10).json()
    assert raw["max_model_len"] == 256 and raw["root"] == default_model_path()
    assert raw == {**client.models.list().data[0].to_dict(), "created": raw["created"]}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.get(server.url + "/v1/models/org/no-such-model", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ----------------------------------------------------------------- 3. /tokenizer_info


def test_tokenizer_info_is_the_tokenizer_config_with_class_and_chat_template(server, tokenizer):
    r = httpx.get(server.url + "/tokenizer_info", timeout=10)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == tokenizer.model_max_length
    # A client can rebuild the prompt the server renders from these fields alone.
    from jinja2 import Template

    text = Template(info["chat_template"]).render(
        messages=[{"role": "user", "content": "sort 3 1"}], add_generation_prompt=True,
        bos_token=info["bos_token"], eos_token=info["eos_token"])
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": "sort 3 1"}],
                                                 add_generation_prompt=True, tokenize=False)


class _FakeEngine:
    class model_config:  # noqa: N801 - the attribute the routes read
        model = "/m"
        max_model_len = 64

    def get_tokenizer(self):
        raise AssertionError("not reached")


def test_tokenizer_info_is_off_unless_enabled_as_in_vllm():
    app = FastAPI()
    add_info_routes(app, _FakeEngine(), lambda name: name, None, enable_tokenizer_info=False)
    http = TestClient(app)
    assert http.get("/tokenizer_info").status_code == 404
    assert http.get("/v1/models/m").json()["id"] == "m"


# ----------------------------------------------------------------- 4. vllm:* metrics


def scrape(server) -> dict[str, dict[tuple, float]]:
    """{metric family name: {sorted label items: value}} of the samples, and the types."""
    families = text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text)
    out: dict[str, dict[tuple, float]] = {}
    for fam in families:
        out.setdefault("#type", {})[(fam.name,)] = fam.type
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    return m[name][tuple(sorted(want.items()))]


VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
}


def test_vllm_metrics_count_a_known_workload(server, client, tokenizer):
    prompt, n_req, n_tok = "sort 9 8 7 6 5 4 3 2 1 0 9 8", 3, 5
    ids = tokenizer(prompt).input_ids
    before = scrape(server)
    for _ in range(n_req):  # one after another: the later ones hit the prefix cache
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n_tok,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n_tok
    after = scrape(server)
    for name, kind in VLLM_TYPES.items():
        assert after["#type"][(name,)] == kind, name

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == n_req
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:prompt_tokens_total") == n_req * len(ids)
    assert delta("vllm:generation_tokens_total") == n_req * n_tok
    assert delta("vllm:time_to_first_token_seconds_count") == n_req
    assert delta("vllm:e2e_request_latency_seconds_count") == n_req
    assert delta("vllm:request_time_per_output_token_seconds_count") == n_req
    # One inter-token interval per later engine step of each request.
    assert delta("vllm:inter_token_latency_seconds_count") == n_req * (n_tok - 1)
    assert delta("vllm:inter_token_latency_seconds_sum") > 0
    assert delta("vllm:prefix_cache_queries_total") == n_req * len(ids)
    assert delta("vllm:prefix_cache_hits_total") > 0
    assert delta("vllm:num_preemptions_total") == 0
    assert value(after, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == \
        value(after, "vllm:e2e_request_latency_seconds_count")
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):
        assert value(after, gauge) == 0, gauge
    # jaxllm's own names stay, with the same values.
    for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_hits_total",
                 "inter_token_latency_seconds_count", "time_to_first_token_seconds_count"):
        assert value(after, "jaxllm:" + name) == value(after, "vllm:" + name), name


# ----------------------------------------------------------------- 5. min_tokens and EOS


def _eos_forced(tokenizer, min_tokens: int, max_tokens: int) -> dict:
    """A greedy request whose logit_bias makes EOS the top token at every step."""
    return {"model": MODEL, "prompt": "count 1 2", "max_tokens": max_tokens,
            "temperature": 0.0, "logit_bias": {str(tokenizer.eos_token_id): 100},
            "min_tokens": min_tokens, "ignore_eos": True, "return_token_ids": True}


def test_min_tokens_masks_eos_even_with_ignore_eos_over_raw_http(server, tokenizer):
    eos = tokenizer.eos_token_id
    r = post(server, "/v1/completions", _eos_forced(tokenizer, 4, 7))
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["token_ids"]
    assert len(tokens) == 7  # ignore_eos: EOS does not stop it
    assert eos not in tokens[:4] and tokens[4:] == [eos] * 3


def test_min_tokens_masks_eos_even_with_ignore_eos_through_the_openai_client(client, tokenizer):
    eos = tokenizer.eos_token_id
    body = _eos_forced(tokenizer, 3, 3)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count 1 2"}], max_tokens=3,
        temperature=0.0, logit_bias=body["logit_bias"],
        extra_body={"min_tokens": 3, "ignore_eos": True, "return_token_ids": True})
    tokens = r.to_dict()["choices"][0]["token_ids"]
    assert len(tokens) == 3 and eos not in tokens
