"""Cross-encoders (Bert/Roberta/XLMRobertaForSequenceClassification), as vLLM serves them:
`LLM.score` runs each pair as one text-pair encoding and equals the sigmoid of
transformers' logit, `LLM.classify` equals its softmax over several labels; what a
cross-encoder does not serve is refused naming the field; and the activations follow
the checkpoint's config as vLLM reads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from jaxllm import LLM, PoolingParams
from jaxllm.errors import ParameterError
from jaxllm.pooler_config import activate, classifier_pooler_config
from tests.compilations import recorded_compilations
from tests.models.tiny_encoder import make_tiny_cross_encoder

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, token_buckets=[32, 128],
              dtype="float32")
QUERIES = ["what is a fox?", "Where is Paris"]
DOCS = ["a fox is a small wild animal", "Paris is the capital of France.", "42",
        "Foxes eat mice, berries and insects; some live in cities."]


def hf_logits(model_dir: str, first: list[str], second: list[str] | None = None
              ) -> np.ndarray:
    """transformers' logits of each text, or of each (first, second) pair's encoding."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()
    rows = []
    for i, a in enumerate(first):
        enc = tok(a, second[i], return_tensors="pt") if second else tok(a, return_tensors="pt")
        with torch.no_grad():
            rows.append(hf(**enc).logits[0].numpy())
    return np.stack(rows).astype(np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_cross_encoder_scores_are_the_sigmoid_of_transformers_pair_logits(tmp_path, family):
    model_dir = make_tiny_cross_encoder(tmp_path, family)
    llm = LLM(model_dir, precompile=True, **ENGINE)
    assert llm.llm_engine.model_config.supported_tasks == ("classify", "score")
    with recorded_compilations() as compiles:
        one_to_many = llm.score(QUERIES[0], DOCS, use_tqdm=False)
        pairwise = llm.score(QUERIES, DOCS[:2], use_tqdm=False)
    assert compiles == []
    want = sigmoid(hf_logits(model_dir, [QUERIES[0]] * 4 + QUERIES, DOCS + DOCS[:2])[:, 0])
    got = [o.outputs.score for o in one_to_many + pairwise]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.ptp(want) > 1e-3  # scores 100 tolerances apart: a wrong encoding would show
    tok = llm.get_tokenizer()
    assert one_to_many[3].prompt_token_ids == tok(QUERIES[0], DOCS[3]).input_ids
    # classify with one label is its sigmoid too (vLLM's), text by text.
    probs = [o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)]
    np.testing.assert_allclose(probs, sigmoid(hf_logits(model_dir, DOCS)), atol=1e-5)
    # A pair longer than max_model_len (128) names the side of the longer text.
    with pytest.raises(ParameterError, match="has 1[0-9]{2} tokens") as e:
        llm.score(QUERIES[0], ["x" * 120], use_tqdm=False)
    assert e.value.field == "data_2"
    with pytest.raises(ParameterError, match="cross-encoder") as e:
        llm.embed("a fox", use_tqdm=False)
    assert e.value.field == "task"
    with pytest.raises(ParameterError, match="embeddings only") as e:
        llm.classify("a fox", pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    assert e.value.field == "normalize"
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_classifier_of_several_labels_gives_transformers_softmax_and_does_not_score(
        tmp_path):
    model_dir = make_tiny_cross_encoder(tmp_path, "xlm-roberta", num_labels=3)
    llm = LLM(model_dir, **ENGINE)
    assert llm.llm_engine.model_config.supported_tasks == ("classify",)
    texts = DOCS + QUERIES
    outs = llm.classify(texts, use_tqdm=False)
    logits = hf_logits(model_dir, texts)
    want = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_allclose([o.outputs.probs for o in outs], want, atol=1e-5)
    assert outs[0].prompt_token_ids == llm.get_tokenizer()(texts[0]).input_ids
    with pytest.raises(ParameterError, match="single label") as e:
        llm.score("a", "b", use_tqdm=False)
    assert e.value.field == "task"


def test_classifier_activations_follow_the_config_as_vllm_reads_it():
    class Config:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    def acts(labels: int, **kw) -> tuple[str, str, str]:
        pc = classifier_pooler_config(Config(**kw), labels)
        return pc.pooling_type, pc.classify_activation, pc.score_activation

    assert acts(1) == ("CLS", "sigmoid", "sigmoid")
    assert acts(3) == ("CLS", "softmax", "softmax")
    assert acts(3, problem_type="multi_label_classification")[1] == "sigmoid"
    assert acts(1, problem_type="regression")[1:] == ("identity", "identity")
    # sentence-transformers' CrossEncoder activation sets the score's (ms-marco: Identity).
    identity = "torch.nn.modules.linear.Identity"
    assert acts(1, sbert_ce_default_activation_function=identity)[1:] == ("sigmoid",
                                                                          "identity")
    assert acts(1, sentence_transformers={"activation_fn": "torch.nn.modules.activation."
                                          "Tanh"})[2] == "tanh"
    assert acts(1, sentence_transformers={"activation_fn": "torch.nn.modules.activation."
                                          "Sigmoid"})[2] == "sigmoid"
    with pytest.raises(ParameterError) as e:
        acts(1, sbert_ce_default_activation_function="os.system")
    assert e.value.field == "config.json:sbert_ce_default_activation_function"
    np.testing.assert_allclose(activate("softmax", np.array([0.0, np.log(3.0)])), [0.25, 0.75])
    np.testing.assert_allclose(activate("sigmoid", np.array([0.0])), [0.5])
