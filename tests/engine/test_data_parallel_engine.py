"""Offline data parallelism: `LLM(data_parallel_size=2, tensor_parallel_size=2)` on 4 fake
CPU devices runs two engine-core processes, each on its own two devices.

Greedy tokens must be transformers' (float32), as a single replica's are
(test_tensor_parallel_engine.py); both cores must produce tokens; an abort must
stop the request on the core that holds it.
"""

from __future__ import annotations

import time

import pytest

from jaxllm import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

pytestmark = pytest.mark.slow  # two engine cores start and compile

NEW_TOKENS = 6
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, token_buckets=[16], request_buckets=[4], seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=2)


@pytest.fixture(scope="module")
def llm(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        # The cores' processes see 4 devices: core 0 takes 0-1, core 1 takes 2-3.
        mp.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
        engine = LLM(model_dir, tensor_parallel_size=2, data_parallel_size=2, **ENGINE)
    yield engine
    engine.llm_engine.shutdown()


def test_two_replicas_give_transformers_greedy_tokens_and_both_produce_tokens(llm, model_dir):
    prompts = random_prompts(checkpoint_vocab_size(model_dir), [9, 5, 12, 7, 3], seed=5)
    core = llm.llm_engine.engine_core
    token_engines: set[int] = set()
    get_output = core.get_output

    def recording_get_output():
        outputs = get_output()
        if outputs.outputs or outputs.token_req_ids:
            token_engines.add(outputs.engine_index)
        return outputs

    core.get_output = recording_get_output
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts,
                                                               NEW_TOKENS)[0]
    assert token_engines == {0, 1}
    assert core.balancer.owner == {} and core.balancer.counts == [0, 0]


def test_an_abort_stops_the_request_on_the_core_that_holds_it(llm, model_dir):
    """The aborted request would outlast the kept one: were the abort sent to the wrong
    core, the kept core would empty first."""
    engine = llm.llm_engine
    core = engine.engine_core
    keep, drop = random_prompts(checkpoint_vocab_size(model_dir), [4, 4], seed=6)
    engine.add_request("keep", {"prompt_token_ids": keep},
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.add_request("drop", {"prompt_token_ids": drop},
                       SamplingParams(temperature=0.0, max_tokens=58, ignore_eos=True))
    keep_core, drop_core = core.balancer.owner["keep"], core.balancer.owner["drop"]
    assert {keep_core, drop_core} == {0, 1}
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    engine.abort_request("drop")
    deadline = time.monotonic() + 30
    while (busy := core.call_utility("has_unfinished_requests", timeout=30)) == [True, True]:
        assert time.monotonic() < deadline, "the aborted request still runs"
        time.sleep(0.02)
    assert busy[keep_core] and not busy[drop_core]
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert len(finished[0].outputs[0].token_ids) == 40
