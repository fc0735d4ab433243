"""The whole engine under tensor parallelism on fake CPU devices, for every attention body.

A GQA checkpoint with 4 q heads over 2 kv heads: at tp 2 each device holds one kv
head, at tp 4 each kv head is replicated on two devices. The mixture-of-experts
families (Mixtral, 4 experts; Qwen3-MoE, 8 experts with a dense layer 1) run the
same workload with their experts split over the devices (expert parallel). The workload is chunked
(a 16-token budget), shares a prefix, runs twice (prefix-cache hits) and fits a
KV cache too small for all of it (preemption). Greedy tokens must be
transformers' (float32) at every tp and on every body, with no compilation
after start-up. The Pallas bodies run in interpret mode.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.sample.metadata import variant_metadata
from tests.compilations import recorded_compilations
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

NEW_TOKENS = 6
HEADS, KV_HEADS, LAYERS = 4, 2, 2
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, token_buckets=[16], request_buckets=[4], seed=0,
              enable_prefix_caching=True, num_kv_blocks=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
_COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


FAMILIES = {
    "llama": dict(arch="llama"),
    "mixtral": dict(arch="mixtral"),
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=8, mlp_only_layers=[1]),
}


class Case(NamedTuple):
    model_dir: str
    prompts: list[list[int]]
    hf_tokens: list[list[int]]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> its checkpoint, prompts and transformers' greedy tokens (built once)."""
    built: dict[str, Case] = {}

    def case(family: str) -> Case:
        if family not in built:
            model_dir = make_tiny_checkpoint(
                tmp_path_factory.mktemp("ckpt"), num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS, **FAMILIES[family])
            vocab = checkpoint_vocab_size(model_dir)
            shared = random_prompts(vocab, [24], seed=3)[0]
            tails = random_prompts(vocab, [16, 6, 5], seed=4)
            prompts = [shared + tails[0], shared + tails[1], tails[2]]
            built[family] = Case(model_dir, prompts, hf_greedy(model_dir, prompts,
                                                               NEW_TOKENS)[0])
        return built[family]

    return case


@pytest.fixture(scope="module")
def model_dir(cases):
    return cases("llama").model_dir


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_runner


@pytest.mark.slow
@pytest.mark.parametrize("family,backend,tp", [
    ("llama", "reference", 1), ("llama", "reference", 2), ("llama", "reference", 4),
    ("llama", "pallas_gpu", 2), ("llama", "pallas_gpu", 4), ("llama", "pallas_tpu", 2),
    ("llama", "pallas_tpu", 4),
    ("mixtral", "reference", 1), ("mixtral", "reference", 2), ("mixtral", "pallas_gpu", 2),
    ("mixtral", "pallas_tpu", 2),
    ("qwen3_moe", "reference", 1), ("qwen3_moe", "reference", 2),
    ("qwen3_moe", "pallas_gpu", 2), ("qwen3_moe", "pallas_tpu", 2)])
def test_greedy_under_tensor_parallelism_matches_transformers_with_chunks_hits_and_preemption(
        family, backend, tp, cases):
    model_dir, prompts, hf_tokens = cases(family)
    llm = LLM(model_dir, attention_backend=backend, attention_interpret=backend != "reference",
              tensor_parallel_size=tp, **ENGINE)
    runner = _runner(llm)
    assert runner.mesh.shape["model"] == tp
    with recorded_compilations() as compiles:
        runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                             use_tqdm=False) for _ in range(2)]
    for outs in runs:
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    stats = llm.llm_engine.last_stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert compiles == []

    # Each device holds its own kv heads: 1/tp of the one-device cache where the kv
    # heads divide, one (replicated) head of the two where they do not.
    shard = runner.kv_cache.addressable_shards[0].data
    one_device = runner.kv_cache.nbytes * KV_HEADS // max(KV_HEADS, tp)
    assert shard.nbytes == one_device // min(tp, KV_HEADS)


def _collectives(hlo: str) -> Counter:
    return Counter(kind for _, kind in _COLLECTIVE.findall(hlo))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas_gpu"])
def test_compiled_step_at_tp2_has_two_all_reduces_per_layer_and_no_kv_gather(
        backend, model_dir):
    """Per layer one all-reduce after the attention's output projection and one after
    the MLP's down projection (both row parallel), plus one for the vocab-parallel
    embedding (each device looks up its vocab rows, zeros elsewhere, summed). Nothing
    gathers the KV cache or the activations. Greedy sampling gathers each device's
    best logit and its id per request (`[R, tp]`), never the `[R, vocab]` logits."""
    llm = LLM(model_dir, attention_backend=backend, attention_interpret=backend != "reference",
              tensor_parallel_size=2, **{**ENGINE, "precompile": False})
    runner = _runner(llm)
    programs = runner.programs
    args = (runner.state, runner.kv_cache, programs.dummy_inputs(16), runner._no_prev)
    forward = programs.forward.lower(*args).compile().as_text()
    assert _collectives(forward) == {"all-reduce": 2 * LAYERS + 1}
    for shape, _ in _COLLECTIVE.findall(forward):
        assert shape.startswith("f32[16,64]") or shape.startswith("f32[4,64]"), shape

    runner.kv_cache, _, last_hidden, out_index = programs.run_forward(*args)
    s = runner.buckets.max_num_seqs
    greedy = next(md for md in variant_metadata(s, runner.vocab_size,
                                                runner.input_batch.sampling.device_put,
                                                out_index) if md.all_greedy)
    sample = programs.sample_fn.lower(programs.head, last_hidden, greedy, size=s)
    gathered = _COLLECTIVE.findall(sample.compile().as_text())
    assert gathered and all(kind == "all-gather" and re.match(rf"[fs]32\[{s},2\]", shape)
                            for shape, kind in gathered), gathered
