"""A cross-encoder over a real server, as vLLM serves one: /score and /v1/score give the
sigmoid of transformers' logit of each pair's encoding, /rerank, /v1/rerank and /v2/rerank
order the documents by it, /classify gives each text's probabilities and label; every bad
field is a 400 naming it, and the embedding route refuses the model."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.server import RemoteServer
from tests.entrypoints.test_openai_server import post
from tests.models.test_cross_encoder import DOCS, QUERIES, hf_logits, sigmoid
from tests.models.tiny_encoder import make_tiny_cross_encoder

pytestmark = pytest.mark.slow  # a server for the module

MODEL = "reranker"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_cross_encoder(tmp_path_factory.mktemp("ce"), "bert")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RemoteServer([model_dir, "--dtype", "float32", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "128", "--token-buckets", "32,128",
                        "--served-model-name", MODEL])
    yield srv
    srv.stop()


def test_http_scores_are_the_sigmoid_of_transformers_pair_logits(server, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    want = sigmoid(hf_logits(model_dir, [QUERIES[0]] * 4, DOCS)[:, 0])
    one_to_many = post(server, "/score", {"model": MODEL, "text_1": QUERIES[0],
                                          "text_2": DOCS}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    assert {d["object"] for d in one_to_many["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], want, atol=1e-5)
    assert one_to_many["usage"]["prompt_tokens"] == sum(
        len(tok(QUERIES[0], d).input_ids) for d in DOCS)
    pairwise = post(server, "/v1/score", {"text_1": QUERIES, "text_2": DOCS[:2]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               sigmoid(hf_logits(model_dir, QUERIES, DOCS[:2])[:, 0]),
                               atol=1e-5)


def test_http_rerank_orders_documents_by_the_cross_encoder_score(server, model_dir):
    want = sigmoid(hf_logits(model_dir, [QUERIES[1]] * 4, DOCS)[:, 0])
    best_first = np.argsort(-want)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        resp = post(server, path, {"model": MODEL, "query": QUERIES[1], "documents": DOCS,
                                   "top_n": 3}).json()
        assert [r["index"] for r in resp["results"]] == list(best_first[:3])
        np.testing.assert_allclose([r["relevance_score"] for r in resp["results"]],
                                   want[best_first[:3]], atol=1e-5)
        assert [r["document"]["text"] for r in resp["results"]] == [
            DOCS[i] for i in best_first[:3]]
        assert resp["model"] == MODEL and resp["usage"]["total_tokens"] > 0


def test_http_classify_gives_each_text_its_probabilities_and_label(server, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    resp = post(server, "/classify", {"model": MODEL, "input": DOCS}).json()
    assert resp["object"] == "list" and resp["id"].startswith("classify-")
    assert resp["model"] == MODEL
    assert [d["index"] for d in resp["data"]] == [0, 1, 2, 3]
    assert {(d["label"], d["num_classes"]) for d in resp["data"]} == {("label_0", 1)}
    np.testing.assert_allclose([d["probs"] for d in resp["data"]],
                               sigmoid(hf_logits(model_dir, DOCS)), atol=1e-5)
    assert resp["usage"]["prompt_tokens"] == sum(len(tok(d).input_ids) for d in DOCS)
    one = post(server, "/classify", {"input": DOCS[2]}).json()
    assert len(one["data"]) == 1
    assert one["data"][0]["probs"] == pytest.approx(resp["data"][2]["probs"], abs=1e-6)


@pytest.mark.parametrize("path,body,param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": "a", "text_2": ["b", "x" * 130]}, "text_2"),
    ("/rerank", {"query": "x" * 130, "documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": ["a", "x" * 130]}, "input"),
    ("/classify", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": "a fox"}, "model"),
])
def test_a_bad_cross_encoder_request_is_a_400_naming_the_field(server, path, body, param):
    resp = post(server, path, {"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text
    assert post(server, "/classify", {"input": "still serving"}).status_code == 200
