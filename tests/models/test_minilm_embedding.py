"""all-MiniLM-L6-v2 (a real sentence-transformers BERT: mean pooling, Normalize): jaxllm's
embeddings equal sentence-transformers' own on a few hundred varied sentences."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM
from tests.models.minilm import minilm_dir, sentences

pytestmark = pytest.mark.slow

ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=1024, token_buckets=[256, 1024],
              dtype="float32")


def reference_embeddings(texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm_dir(), device="cpu")
    return st.encode(texts, batch_size=64, convert_to_numpy=True)


def test_minilm_embeddings_match_sentence_transformers():
    texts = sentences(300)
    llm = LLM(minilm_dir(), **ENGINE)
    assert llm.llm_engine.model_config.max_model_len == 256  # sentence_bert_config's cap
    got = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    want = reference_embeddings(texts)
    assert got.shape == want.shape == (300, 384)
    cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() >= 0.9999, (cosine.argmin(), cosine.min())
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
