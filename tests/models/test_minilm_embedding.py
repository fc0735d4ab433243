"""all-MiniLM-L6-v2 (a real sentence-transformers BERT: mean pooling, Normalize): jaxllm's
embeddings equal sentence-transformers' own on a few hundred varied sentences, and
`LLM.score` gives their cosine similarities as vLLM's does for embedding models."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM
from jaxllm.errors import ParameterError
from tests.models.minilm import minilm_dir, sentences

pytestmark = pytest.mark.slow

ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=1024, token_buckets=[256, 1024],
              dtype="float32")


def reference_embeddings(texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm_dir(), device="cpu")
    return st.encode(texts, batch_size=64, convert_to_numpy=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(minilm_dir(), **ENGINE)


def test_minilm_embeddings_match_sentence_transformers(llm):
    texts = sentences(300)
    assert llm.llm_engine.model_config.max_model_len == 256  # sentence_bert_config's cap
    got = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    want = reference_embeddings(texts)
    assert got.shape == want.shape == (300, 384)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.9999, (cosine.argmin(), cosine.min())
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_scores_are_sentence_transformers_cosine_similarities_one_to_many_and_pairwise(llm):
    from sentence_transformers.util import cos_sim

    queries, docs = sentences(3, seed=1), sentences(5, seed=2)
    want = cos_sim(reference_embeddings(queries), reference_embeddings(docs)).numpy()
    one_to_many = llm.score(queries[0], docs, use_tqdm=False)
    assert [o.outputs.score for o in one_to_many] == pytest.approx(want[0], abs=1e-4)
    pairwise = llm.score(queries, docs[:3], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx(np.diag(want[:, :3]), abs=1e-4)
    [single] = llm.score(queries[1], docs[4], use_tqdm=False)
    assert single.outputs.score == pytest.approx(want[1, 4], abs=1e-4)
    tokenizer = llm.get_tokenizer()
    assert single.prompt_token_ids == (tokenizer(queries[1])["input_ids"]
                                       + [tokenizer.pad_token_id]
                                       + tokenizer(docs[4])["input_ids"])


@pytest.mark.parametrize("data_1, data_2, field", [
    (["a", "b"], ["c", "d", "e"], "data_1"), ([], ["c"], "data_1"), (["a"], [], "data_2")])
def test_score_inputs_that_do_not_pair_name_the_field(llm, data_1, data_2, field):
    with pytest.raises(ParameterError, match=f"^{field}: "):
        llm.score(data_1, data_2, use_tqdm=False)
