"""vLLM's `num_gpu_blocks_override` with KV cache groups: the block pool's size, null
block included, each block id a page in each layer of one group, as vLLM's hybrid
allocator counts them (its kv_cache_utils: `num_blocks` is the override, and the
cache is `group_size` tensors of `num_blocks` pages, one shared by a layer of every
group); an override that cannot hold one request of max_model_len is an error naming
the field."""

from __future__ import annotations

import argparse

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.entrypoints.arg_utils import add_engine_args, engine_args_from
from jaxllm.errors import ParameterError
from tests.engine.hf_reference import random_prompts
from tests.engine.test_sliding_window_engine import CASES
from tests.models.tiny_checkpoints import make_tiny_checkpoint

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
              block_size=4, token_buckets=[16], request_buckets=[2], precompile=False)
# Per model: vLLM's layers per group (its rule: the fewest layers of one attention
# type, unless the most is under 1.5 times that) and the fewest blocks that hold one
# request of 64 tokens computing 16 a step: 16 blocks of the global group, and per
# local group the blocks of window - 1 + 16 = 23 tokens plus one (7), and the null block.
EXPECTED = {
    "gemma3-five-local-one-global": dict(group_size=1, min_blocks=16 + 5 * 7 + 1),
    "gemma2-four-alternating": dict(group_size=2, min_blocks=16 + 7 + 1),
}


@pytest.fixture(scope="module", params=list(EXPECTED))
def case(request, tmp_path_factory):
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param),
                                     **CASES[request.param])
    return model_dir, EXPECTED[request.param]


def test_the_override_is_the_pool_of_block_ids_each_a_page_per_layer_of_a_group(case):
    model_dir, want = case
    n = want["min_blocks"]
    llm = LLM(model_dir, **ENGINE, num_gpu_blocks_override=n)
    core = llm.llm_engine.engine_core.engine_core
    runner, pool = core.model_runner, core.scheduler.kv_cache_manager.block_pool
    assert runner.kv_groups.group_size == want["group_size"]
    assert runner.num_kv_blocks == n and len(pool.blocks) == n
    assert pool.get_num_free_blocks() == n - 1  # the null block is one of them
    # group_size pages (one per layer of a group) for each of the n block ids.
    assert runner.kv_cache.shape[0] == want["group_size"] * n
    # One request of max_model_len fits: it runs to its end.
    prompt = random_prompts(256, [56], seed=1)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert core.scheduler.num_preemptions == 0


def test_an_override_too_small_for_one_request_names_the_field(case):
    model_dir, want = case
    with pytest.raises(ParameterError, match="max_model_len=64") as err:
        LLM(model_dir, **ENGINE, num_gpu_blocks_override=want["min_blocks"] - 1)
    assert err.value.field == "num_gpu_blocks_override"


@pytest.mark.parametrize("kw, field", [
    (dict(num_gpu_blocks_override=0), "num_gpu_blocks_override"),
    (dict(num_kv_blocks=-3), "num_kv_blocks"),
    (dict(num_kv_blocks=8, num_gpu_blocks_override=30), "num_gpu_blocks_override"),
])
def test_bad_block_counts_name_the_field(model_dir, kw, field):
    with pytest.raises(ParameterError) as err:
        EngineArgs(model=model_dir, **kw).create_engine_config()
    assert err.value.field == field


def test_the_cli_takes_vllms_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--num-gpu-blocks-override", "40"]))
    assert args.num_gpu_blocks_override == 40 and args.num_kv_blocks is None
