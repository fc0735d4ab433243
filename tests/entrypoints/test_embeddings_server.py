"""/v1/embeddings over a real server: all-MiniLM-L6-v2 matches sentence-transformers through
the official openai client (float and base64); input forms, usage, and every bad field is a
400 naming it; a model asked for what it does not serve (generation, /classify) gets a
clear 400. /score and /rerank give sentence-transformers' cosine similarities, as vLLM's
do for embedding models."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer
from tests.entrypoints.test_openai_server import post
from tests.models.minilm import minilm_dir, sentences
from tests.models.test_minilm_embedding import reference_embeddings
from tests.models.tiny_checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # servers for the module

MODEL = "minilm"


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([minilm_dir(), "--dtype", "float32", "--max-num-seqs", "64",
                        "--max-num-batched-tokens", "1024", "--token-buckets", "256,1024",
                        "--served-model-name", MODEL])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_http_embeddings_match_sentence_transformers(client):
    """300 sentences in three requests: float, base64 decoded here, and the client's
    default (it asks for base64 and decodes it itself)."""
    texts = sentences(300, seed=1)
    got = []
    for i, fmt in enumerate(["float", "base64", openai.NOT_GIVEN]):
        resp = client.embeddings.create(model=MODEL, input=texts[100 * i:100 * (i + 1)],
                                        encoding_format=fmt)
        assert [d.index for d in resp.data] == list(range(100))
        for d in resp.data:
            if fmt == "base64":  # little-endian float32 bytes
                assert isinstance(d.embedding, str)
                got.append(np.frombuffer(base64.b64decode(d.embedding), "<f4"))
            else:
                got.append(d.embedding)
    got = np.array(got, np.float32)
    assert got.shape == (300, 384)
    assert cosines(got, reference_embeddings(texts)).min() >= 0.9999


def test_input_forms_and_usage(client, server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    texts = ["a red fox", "the quick brown dog jumps over it"]
    ids = [tok(t).input_ids for t in texts]
    one = client.embeddings.create(model=MODEL, input=texts[0])
    many = client.embeddings.create(model=MODEL, input=texts)
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    single_ids = client.embeddings.create(model=MODEL, input=ids[1])
    assert (len(one.data), len(many.data), len(by_ids.data), len(single_ids.data)) == (1, 2, 2, 1)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])
    assert many.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert one.model == MODEL and one.object == "list"
    vec = lambda r, i: np.array(r.data[i].embedding)  # noqa: E731
    for a, b in ((vec(one, 0), vec(many, 0)), (vec(many, 1), vec(by_ids, 1)),
                 (vec(by_ids, 1), vec(single_ids, 0))):
        np.testing.assert_allclose(a, b, atol=1e-5)
    raw = post(server, "/v1/embeddings", {"input": "hello", "encoding_format": "float"}).json()
    assert raw["data"][0]["object"] == "embedding" and len(raw["data"][0]["embedding"]) == 384
    assert raw["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "dimensions": 16}, "dimensions"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": [[5, 6], []]}, "input"),
    ({"input": [5, 10**9]}, "input"),
    ({"input": [101] + [1000] * 300 + [102]}, "input"),  # more than max_model_len (256)
    ({"input": {"text": "hi"}}, "input"),
    ({"input": "hi", "normalize": "maybe"}, "normalize"),
])
def test_a_bad_field_is_a_400_naming_it(server, body, param):
    resp = post(server, "/v1/embeddings", {"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_an_embedding_model_refuses_generation_classification_and_unknown_models(server):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/classify", {"input": "hi"})):
        resp = post(server, path, {"model": MODEL, **body})
        assert resp.status_code == 400 and "does not support" in resp.text, resp.text
        assert resp.json()["error"]["param"] == "model"
    assert post(server, "/v1/embeddings", {"model": "nope", "input": "hi"}).status_code == 404
    # The server still serves after every refusal.
    assert post(server, "/v1/embeddings", {"model": MODEL, "input": "hi"}).status_code == 200


def test_scores_and_reranking_are_sentence_transformers_cosine_similarities(server):
    from sentence_transformers.util import cos_sim
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    queries, docs = sentences(2, seed=3), sentences(4, seed=4)
    want = cos_sim(reference_embeddings(queries), reference_embeddings(docs)).numpy()
    one_to_many = post(server, "/score", {"model": MODEL, "text_1": queries[0],
                                          "text_2": docs}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    assert {d["object"] for d in one_to_many["data"]} == {"score"}
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(want[0], abs=1e-4)
    pair_tokens = [len(tok(queries[0]).input_ids) + 1 + len(tok(d).input_ids) for d in docs]
    assert one_to_many["usage"]["prompt_tokens"] == sum(pair_tokens)
    pairwise = post(server, "/v1/score", {"text_1": queries, "text_2": docs[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(np.diag(want[:, :2]),
                                                                   abs=1e-4)
    best_first = np.argsort(-want[1])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        resp = post(server, path, {"model": MODEL, "query": queries[1], "documents": docs,
                                   "top_n": 3}).json()
        assert [r["index"] for r in resp["results"]] == list(best_first[:3])
        assert [r["relevance_score"] for r in resp["results"]] == pytest.approx(
            want[1][best_first[:3]], abs=1e-4)
        assert [r["document"]["text"] for r in resp["results"]] == [
            docs[i] for i in best_first[:3]]
        assert resp["model"] == MODEL and resp["usage"]["total_tokens"] > 0
    every = post(server, "/rerank", {"query": queries[1], "documents": docs}).json()
    assert len(every["results"]) == 4


@pytest.mark.parametrize("path,body,param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"text_1": [], "text_2": ["c"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": "a", "text_2": ["b", "word " * 300]}, "text_2"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "word " * 300, "documents": ["a"]}, "query"),
])
def test_a_bad_score_or_rerank_field_is_a_400_naming_it(server, path, body, param):
    resp = post(server, path, {"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_a_generate_only_decoder_refuses_embeddings(tmp_path):
    model = make_tiny_checkpoint(tmp_path, arch="llama")
    srv = RemoteServer([model, *TINY_ENGINE_FLAGS, "--runner", "generate"])
    try:
        resp = post(srv, "/v1/embeddings", {"input": [5, 6, 7]})
        assert resp.status_code == 400, resp.text
        assert "does not support Embeddings API" in resp.json()["error"]["message"]
        resp = post(srv, "/score", {"text_1": "a", "text_2": "b"})
        assert resp.status_code == 400, resp.text
        assert "does not support Score API" in resp.json()["error"]["message"]
        assert post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}
                    ).status_code == 200
    finally:
        srv.stop()
