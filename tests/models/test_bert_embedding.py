"""BertModel encoders: pooled embeddings equal transformers' float32 hidden states pooled as
the checkpoint's sentence-transformers config says (mean, CLS, last token), at
tensor_parallel_size 1 and 2, in ragged batches, without compiling after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertModel

from jaxllm import LLM, PoolingParams, SamplingParams
from jaxllm.errors import ParameterError
from tests.compilations import recorded_compilations
from tests.models.tiny_encoder import make_tiny_bert

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, token_buckets=[32, 128],
              dtype="float32")
# Lengths 1..60: a step packs several requests, and one fills most of a bucket alone.
PROMPTS = [[(7 * i + 3 * j) % 250 + 4 for j in range(n)]
           for i, n in enumerate([5, 1, 17, 60, 3, 33, 8, 2, 41, 12])]


def hf_pooled(model_dir: str, prompts: list[list[int]], pooling: str,
              normalize: bool) -> np.ndarray:
    hf = BertModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            h = hf(torch.tensor([p])).last_hidden_state[0].numpy()
        v = {"mean": h.mean(0), "cls": h[0], "lasttoken": h[-1]}[pooling]
        out.append(v / np.linalg.norm(v) if normalize else v)
    return np.stack(out)


def embed(llm: LLM, prompts: list[list[int]], **params) -> np.ndarray:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts],
                     PoolingParams(**params) if params else None, use_tqdm=False)
    return np.array([o.outputs.embedding for o in outs])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", True),
                                               ("lasttoken", False)])
def test_embeddings_equal_transformers_pooled_hidden_states(tmp_path, pooling, normalize, tp):
    model_dir = make_tiny_bert(tmp_path, pooling, normalize=normalize)
    llm = LLM(model_dir, tensor_parallel_size=tp, precompile=True, **ENGINE)
    with recorded_compilations() as compiles:
        got = embed(llm, PROMPTS)
    assert compiles == []
    want = hf_pooled(model_dir, PROMPTS, pooling, normalize)
    assert got.shape == want.shape == (len(PROMPTS), 64)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # The request's own normalize overrides the checkpoint's.
    flipped = embed(llm, PROMPTS[:3], normalize=not normalize)
    np.testing.assert_allclose(flipped, hf_pooled(model_dir, PROMPTS[:3], pooling,
                                                  not normalize), atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_encoder_takes_whole_prompts_and_refuses_generation_and_long_prompts(tmp_path):
    model_dir = make_tiny_bert(tmp_path, "mean", max_position_embeddings=64,
                               is_matryoshka=True)
    llm = LLM(model_dir, runner="pooling", **ENGINE)
    config = llm.llm_engine.config
    assert config.model_config.max_model_len == 64
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill
    core = llm.llm_engine.engine_core.engine_core
    assert core.model_runner.kv_cache_bytes == 0  # no KV cache on the device
    # A 64-token prompt (the whole context) runs; one more token is refused, named.
    (out,) = llm.embed({"prompt_token_ids": list(range(4, 68))}, use_tqdm=False)
    assert len(out.outputs.embedding) == 64
    with pytest.raises(ParameterError, match="65 tokens") as e:
        llm.embed({"prompt_token_ids": list(range(4, 69))}, use_tqdm=False)
    assert e.value.field == "prompt"
    with pytest.raises(ParameterError, match="does not support generation") as e:
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    # A matryoshka model keeps the first `dimensions` of the pooled vector, then normalizes.
    full = embed(llm, PROMPTS[:2], normalize=False)
    short = embed(llm, PROMPTS[:2], dimensions=8)
    np.testing.assert_allclose(short, full[:, :8] / np.linalg.norm(full[:, :8], axis=1,
                                                                   keepdims=True), atol=1e-6)
    with pytest.raises(ParameterError, match="at most 64") as e:
        llm.embed({"prompt_token_ids": [5, 6]}, PoolingParams(dimensions=65), use_tqdm=False)
    assert e.value.field == "dimensions"
    assert not llm.llm_engine.has_unfinished_requests()


def test_an_encoder_cannot_run_as_a_generator(tmp_path):
    model_dir = make_tiny_bert(tmp_path, "cls")
    with pytest.raises(ParameterError, match="only embeds") as e:
        LLM(model_dir, runner="generate", **ENGINE)
    assert e.value.field == "runner"


def test_encoder_model_config_reads_the_sentence_transformers_pooling(tmp_path):
    from jaxllm.config import EngineArgs

    for pooling, want in (("mean", "MEAN"), ("cls", "CLS"), ("lasttoken", "LAST")):
        mc = EngineArgs(model=make_tiny_bert(tmp_path, pooling, normalize=False),
                        **ENGINE).create_engine_config().model_config
        assert (mc.is_encoder, mc.supported_tasks) == (True, ("embed",))
        assert (mc.pooler_config.pooling_type, mc.pooler_config.normalize) == (want, False)


def test_runner_restricts_a_decoder_to_one_task(tmp_path):
    from jaxllm.config import EngineArgs
    from jaxllm.engine.input_processor import InputProcessor
    from tests.models.tiny_checkpoints import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    tasks = {}
    for kw in ({}, {"runner": "generate"}, {"runner": "pooling"}, {"task": "embed"}):
        mc = EngineArgs(model=model_dir, **kw).create_engine_config().model_config
        tasks[tuple(kw.values()) or ("auto",)] = mc.supported_tasks
        ip = InputProcessor(mc, None)
        for params in (SamplingParams(max_tokens=2), PoolingParams()):
            task = "generate" if isinstance(params, SamplingParams) else "embed"
            if task in mc.supported_tasks:
                ip.process("r", [5, 6], params)
            else:
                with pytest.raises(ParameterError, match="does not support") as e:
                    ip.process("r", [5, 6], params)
                assert e.value.field == "task"
    assert tasks == {("auto",): ("generate", "embed"), ("generate",): ("generate",),
                     ("pooling",): ("embed",), ("embed",): ("embed",)}
    with pytest.raises(ParameterError) as e:
        EngineArgs(model=model_dir, runner="classify").create_engine_config()
    assert e.value.field == "runner"


def test_a_decoder_whose_pooling_config_is_not_last_token_does_not_embed(tmp_path):
    import json
    import os

    from jaxllm.config import EngineArgs
    from tests.models.tiny_checkpoints import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    bert_dir = make_tiny_bert(tmp_path, "mean")
    for name in ("modules.json", os.path.join("1_Pooling", "config.json")):
        os.makedirs(os.path.dirname(os.path.join(model_dir, name)), exist_ok=True)
        with open(os.path.join(bert_dir, name)) as f, open(os.path.join(model_dir, name),
                                                          "w") as g:
            json.dump(json.load(f), g)
    mc = EngineArgs(model=model_dir).create_engine_config().model_config
    assert mc.supported_tasks == ("generate",)
    with pytest.raises(ParameterError, match="MEAN pooling") as e:
        EngineArgs(model=model_dir, runner="pooling").create_engine_config()
    assert e.value.field == "1_Pooling/config.json"
