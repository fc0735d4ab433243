"""GPT-OSS's attention sinks through the whole engine on each Pallas attention body (Pallas
interpret mode on the CPU): transformers' greedy tokens under chunked prefill beside
decodes, sliding-window layers shorter than the prompts."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

NEW_TOKENS = 6
LENGTHS = [3, 45, 11]  # the 45-token prompt is cut into chunks beside the others' decodes
ENGINE = dict(dtype="float32", max_model_len=80, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=8, token_buckets=[32], request_buckets=[4], seed=0,
              precompile=False, enable_prefix_caching=False)

pytestmark = pytest.mark.slow  # the Pallas bodies in interpret mode


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpt-oss"), arch="gpt_oss",
                                num_key_value_heads=2, sliding_window=8)


@pytest.fixture(scope="module")
def prompts(model_dir):
    return random_prompts(checkpoint_vocab_size(model_dir), LENGTHS, seed=11)


@pytest.fixture(scope="module")
def hf_tokens(model_dir, prompts):
    return hf_greedy(model_dir, prompts, NEW_TOKENS)[0]


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_gpt_oss_sinks_on_a_pallas_body_give_transformers_greedy_tokens(
        backend, model_dir, prompts, hf_tokens):
    llm = LLM(model_dir, attention_backend=backend, attention_interpret=True, **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert (runner.attn_backend.name, runner.attn_backend.interpret) == (backend, True)
    runner.step_log = []
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    mixed = [s for s in runner.step_log if s.num_reqs > 1 and s.num_tokens > s.num_reqs]
    assert mixed, runner.step_log  # prompt chunks ran beside decodes
