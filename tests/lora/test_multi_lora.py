"""Multi-LoRA: requests with different adapters and without one share a batch, and each
gets transformers' greedy tokens with its adapter merged (float32), at tp 1 and 2."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ParameterError
from jaxllm.lora.request import LoRARequest
from tests.compilations import recorded_compilations
from tests.engine.hf_reference import hf_greedy, hf_prompt_logprobs, random_prompts
from tests.lora.peft_adapters import ADAPTERS, make_peft_adapter, merged_greedy
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

NEW_TOKENS = 5
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=8, token_buckets=[8, 32], request_buckets=[4], seed=0,
              enable_lora=True, max_lora_rank=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base dir, prompts, {name: (LoRARequest, merged greedy tokens, merged dir)}, base
    tokens)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root, arch="llama", num_attention_heads=4,
                                num_key_value_heads=2)
    prompts = random_prompts(checkpoint_vocab_size(base), [11, 7, 13, 9], seed=5)
    adapters = {}
    for i, (name, fields) in enumerate(ADAPTERS.items()):
        adapter_dir, merged = make_peft_adapter(base, root, seed=i, **fields)
        adapters[name] = (LoRARequest(name, i + 1, adapter_dir),
                          merged_greedy(merged, prompts, NEW_TOKENS), merged)
    return base, prompts, adapters, hf_greedy(base, prompts, NEW_TOKENS)[0]


def _mixed_batch(setup) -> tuple[list[dict], list[LoRARequest | None], list[list[int]]]:
    """Prompt i runs adapter i (the last prompt none): inputs, adapters, expected tokens."""
    _, prompts, adapters, base_tokens = setup
    loras, want = [], []
    for i, (lora, merged, _) in enumerate(adapters.values()):
        loras.append(lora)
        want.append(merged[i])
    loras.append(None)
    want.append(base_tokens[3])
    return [{"prompt_token_ids": p} for p in prompts], loras, want


def _check_mixed_batch(llm: LLM, setup) -> None:
    inputs, loras, want = _mixed_batch(setup)
    outs = llm.generate(inputs, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == want
    # Each adapter really changes the output (the test would not see a missing term).
    _, _, adapters, base_tokens = setup
    for i, (_, merged, _) in enumerate(adapters.values()):
        assert merged[i] != base_tokens[i]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_batch_mixing_three_adapters_and_the_base_model_matches_merged_transformers(setup, tp):
    """At tp 2 the tables shard as the base weights (B over column-parallel outputs,
    A over row-parallel inputs)."""
    llm = LLM(setup[0], max_loras=3, tensor_parallel_size=tp, precompile=True, **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert runner.mesh.shape["model"] == tp
    with recorded_compilations() as compiles:
        _check_mixed_batch(llm, setup)
        _check_mixed_batch(llm, setup)  # again: slots already hold the adapters
    assert compiles == []
    # Layer 0's tables: qkv's A and B (q/k/v parts stacked), then o_proj's A and B.
    qkv_a, qkv_b, o_a, o_b = (runner.state[i] for i in runner.lora.indices[:4])
    assert qkv_b.sharding.spec[3] == "model"  # B over the column-parallel kv-head axis
    assert o_a.sharding.spec[3] == "model"  # A over the row-parallel head axis
    assert qkv_b.addressable_shards[0].data.shape[3] == qkv_b.shape[3] // tp
    assert o_a.addressable_shards[0].data.shape[3] == o_a.shape[3] // tp
    assert set(qkv_a.sharding.spec) <= {None} and set(o_b.sharding.spec) <= {None}


@pytest.mark.slow
def test_fewer_slots_than_adapters_evicts_and_queues_with_the_same_tokens(setup):
    """max_loras=2 with three adapters in flight: the third waits for a slot, and slots
    are reloaded as adapters come and go; every request still gets its tokens."""
    llm = LLM(setup[0], max_loras=2, precompile=True, **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    with recorded_compilations() as compiles:
        _check_mixed_batch(llm, setup)
    assert compiles == []
    assert runner.lora.loads >= 3


@pytest.mark.slow
def test_lora_off_leaves_the_model_without_adapter_tables(setup):
    llm = LLM(setup[0], **{**ENGINE, "enable_lora": False})
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert runner.lora is None and runner.programs.lora_args == ()
    with pytest.raises(ParameterError, match="lora_request"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False,
                     lora_request=setup[2]["all"][0])


@pytest.mark.slow
def test_rank_above_max_lora_rank_is_an_error_and_chat_takes_lora_request(setup):
    llm = LLM(setup[0], max_loras=1, **{**ENGINE, "max_lora_rank": 4})
    with pytest.raises(ParameterError, match="max_lora_rank"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False,
                     lora_request=setup[2]["all"][0])
    # A rank-4 adapter fits; chat runs it as generate does on the rendered prompt.
    lora = setup[2]["qv_rslora"][0]
    messages = [{"role": "user", "content": "hello"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=lora)[0]
    plain = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    direct = llm.generate([{"prompt_token_ids": chat.prompt_token_ids}], GREEDY,
                          use_tqdm=False, lora_request=lora)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert chat.outputs[0].token_ids != plain.outputs[0].token_ids


@pytest.mark.slow
def test_prefix_cache_never_serves_one_adapters_blocks_to_another_or_the_base(setup):
    """The same 3-block prompt, base first, then adapters: each gets its own tokens and
    no hit on the others' blocks; a repeat with the same adapter hits."""
    base, _, adapters, _ = setup
    prompt = random_prompts(checkpoint_vocab_size(base), [25], seed=9)[0]
    want = {name: merged_greedy(merged, [prompt], NEW_TOKENS)[0]
            for name, (_, _, merged) in adapters.items()}
    want[None] = hf_greedy(base, [prompt], NEW_TOKENS)[0][0]
    llm = LLM(base, max_loras=3, **{**ENGINE, "enable_prefix_caching": True})

    def run(name: str | None) -> int:
        """Runs the prompt with adapter `name`; returns the prefix-cache hits it got."""
        before = llm.llm_engine.last_stats.prefix_cache_hits if llm.llm_engine.last_stats \
            else 0
        lora = adapters[name][0] if name else None
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False,
                           lora_request=lora)[0]
        assert out.outputs[0].token_ids == want[name], name
        return llm.llm_engine.last_stats.prefix_cache_hits - before

    assert run(None) == 0
    assert run("all") == 0
    assert run("qv_rslora") == 0
    assert run("all") == 24  # its own three full blocks
    assert run(None) == 24

    # Prompt logprobs under an adapter (the 25-token step re-runs its last layer for
    # every row) are the merged model's.
    lora, _, merged = adapters["mlp_ko"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False,
                       lora_request=lora)[0]
    got = [lp[t].logprob for t, lp in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)]
    want_lp = hf_prompt_logprobs(merged, [prompt])[0]
    assert max(abs(g - w) for g, w in zip(got, want_lp, strict=True)) < 1e-4


# Families whose adapters meet a projection laid out apart from Llama's, each with the
# (PEFT) modules that do: Phi-3's checkpoint fuses q/k/v and gate/up itself; Granite's
# o_proj and down_proj carry its residual multiplier as they load, so their adapters'
# terms take it too; GLM's q and k rows load permuted (interleaved rope read as
# rotate-half), so their B rows are permuted alike; OLMo 2 norms q and k over all heads
# after the projections, adapters included; Arcee's MLP has no gate.
FAMILY_ADAPTERS = {
    "phi3-fused-modules": (dict(arch="phi3"),
                           ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "granite-residual-multiplier": (dict(arch="granite", residual_multiplier=0.3,
                                         embedding_multiplier=4.0, logits_scaling=2.0),
                                    ["o_proj", "down_proj"]),
    "glm4-interleaved-rope-order": (dict(arch="glm4", partial_rotary_factor=0.5),
                                    ["q_proj", "k_proj"]),
    "olmo2-before-the-whole-qk-norms": (dict(arch="olmo2"), ["q_proj", "k_proj", "v_proj"]),
    "arcee-non-gated-mlp": (dict(arch="arcee"), ["up_proj", "down_proj", "q_proj"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FAMILY_ADAPTERS))
def test_a_family_adapter_served_from_the_tables_gives_the_merged_models_tokens(case,
                                                                               tmp_path):
    fields, modules = FAMILY_ADAPTERS[case]
    base = make_tiny_checkpoint(tmp_path, num_attention_heads=4, num_key_value_heads=2,
                                **fields)
    prompts = random_prompts(checkpoint_vocab_size(base), [11, 7], seed=len(case))
    adapter, merged = make_peft_adapter(base, tmp_path, seed=len(case) + 1, r=8,
                                        lora_alpha=16, target_modules=modules)
    want = merged_greedy(merged, prompts, NEW_TOKENS)
    assert want != hf_greedy(base, prompts, NEW_TOKENS)[0]
    llm = LLM(base, max_loras=1, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest(case, 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == want
