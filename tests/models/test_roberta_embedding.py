"""RobertaModel and XLMRobertaModel encoders: pooled embeddings equal transformers' float32
hidden states pooled as the sentence-transformers config says, positions offset by
padding_idx + 1 up to the whole usable table, whether the checkpoint names its tensors
bare or under `roberta.` / `model.` beside heads it does not use."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from jaxllm import LLM
from jaxllm.errors import ParameterError
from tests.models.tiny_encoder import make_tiny_roberta

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, token_buckets=[32, 128],
              dtype="float32")
# Ids from 4 up: none is the pad id (1), which transformers would not number.
PROMPTS = [[(5 * i + 3 * j) % 250 + 4 for j in range(n)]
           for i, n in enumerate([6, 1, 19, 128, 40, 3])]


def hf_pooled(model_dir: str, prompts: list[list[int]], pooling: str,
              normalize: bool) -> np.ndarray:
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            h = hf(torch.tensor([p])).last_hidden_state[0].numpy()
        v = h.mean(0) if pooling == "mean" else h[0]
        out.append(v / np.linalg.norm(v) if normalize else v)
    return np.stack(out)


def embed(llm: LLM, prompts: list[list[int]]) -> np.ndarray:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return np.array([o.outputs.embedding for o in outs])


def resave_with_prefix(model_dir: str, prefix: str) -> None:
    """The checkpoint's tensors renamed `prefix` + name, beside a masked-LM head's."""
    path = os.path.join(model_dir, "model.safetensors")
    tensors = {prefix + k: v for k, v in load_file(path).items()}
    tensors["lm_head.dense.weight"] = torch.zeros(4, 4)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.parametrize("family,pooling,normalize,prefix", [
    ("xlm-roberta", "mean", True, ""), ("roberta", "cls", False, ""),
    ("xlm-roberta", "cls", True, "roberta."), ("roberta", "mean", True, "model.")])
def test_roberta_embeddings_equal_transformers_pooled_hidden_states(
        tmp_path, family, pooling, normalize, prefix):
    model_dir = make_tiny_roberta(tmp_path, family, pooling, normalize=normalize)
    want = hf_pooled(model_dir, PROMPTS, pooling, normalize)  # before any renaming
    if prefix:
        resave_with_prefix(model_dir, prefix)
    llm = LLM(model_dir, **ENGINE)
    # 130 position rows, numbered from padding_idx + 1 = 2: 128 usable.
    assert llm.llm_engine.model_config.max_model_len == 128
    got = embed(llm, PROMPTS)
    assert got.shape == want.shape == (len(PROMPTS), 64)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ParameterError, match="129 tokens") as e:
        llm.embed({"prompt_token_ids": [5] * 129}, use_tqdm=False)
    assert e.value.field == "prompt"


def test_a_max_model_len_past_the_offset_position_table_is_refused(tmp_path):
    from jaxllm.config import EngineArgs

    model_dir = make_tiny_roberta(tmp_path)
    with pytest.raises(ParameterError, match="holds \\(128") as e:
        EngineArgs(model=model_dir, max_model_len=130, **ENGINE).create_engine_config()
    assert e.value.field == "max_model_len"
