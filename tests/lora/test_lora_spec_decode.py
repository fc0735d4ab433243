"""Multi-LoRA with speculative decoding: the verify forward runs the target with each
request's adapter, so greedy output equals the same LoRA batch without speculation,
requests with three adapters and the base model mixed in one batch; drafts come from
the ngram proposer, or from a draft model (the base model, without adapters)."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.lora.request import LoRARequest
from tests.compilations import recorded_compilations
from tests.engine.hf_reference import random_prompts
from tests.engine.test_spec_decode import SPEC, _record_spec_stats, _totals
from tests.lora.peft_adapters import ADAPTERS, make_peft_adapter
from tests.lora.test_multi_lora import ENGINE
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.slow
def test_lora_with_ngram_or_draft_model_speculation_equals_lora_without_it(tmp_path):
    base = make_tiny_checkpoint(tmp_path, arch="llama", num_attention_heads=4,
                                num_key_value_heads=2)
    loras = [None]
    for i, (name, fields) in enumerate(ADAPTERS.items()):
        adapter_dir, _ = make_peft_adapter(base, tmp_path, seed=i, **fields)
        loras.append(LoRARequest(name, i + 1, adapter_dir))
    # Prompts that repeat themselves, so the ngram proposer finds drafts; each one runs
    # with every adapter and with none.
    rand = random_prompts(checkpoint_vocab_size(base), [5, 7], seed=3)
    prompts = [rand[0] * 3, rand[1] * 2]
    inputs = [{"prompt_token_ids": p} for p in prompts for _ in loras]
    requests = [lora for _ in prompts for lora in loras]
    engine = {**ENGINE, "max_model_len": 128, "max_num_seqs": 8, "request_buckets": [8],
              "max_num_batched_tokens": 64, "token_buckets": [16, 64], "max_loras": 4}

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate(inputs, GREEDY, use_tqdm=False, lora_request=requests)
        return [list(o.outputs[0].token_ids) for o in outs]

    want = run(LLM(base, **engine))
    for p in range(len(prompts)):  # every adapter changes that prompt's tokens
        row = want[p * len(loras):(p + 1) * len(loras)]
        assert all(row[j] != row[0] for j in range(1, len(loras)))
    draft_model = {"method": "draft_model", "model": base, "num_speculative_tokens": 3}
    for spec in (SPEC, draft_model):
        llm = LLM(base, **engine, speculative_config=spec, precompile=True)
        stats = _record_spec_stats(llm)
        with recorded_compilations() as compiles:
            got = run(llm)
        assert compiles == []
        assert got == want, spec["method"]
        drafts, draft_tokens, accepted = _totals(stats)
        assert drafts > 0 and 0 < accepted <= draft_tokens  # verify steps really ran
        del llm
