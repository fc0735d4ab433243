"""Sliding-window layers that let go of out-of-window KV blocks still give transformers'
greedy tokens and prompt logprobs (float32), under chunked prefill, prefix-cache hits
and preemption; the two-layer groups on both Pallas bodies (interpret mode) and at tp 2
too (tests/engine/test_tensor_parallel_engine.py runs 2-layer Gemma 2 and 3, one group
per layer, on every body at tp 2).

Gemma 3 with five local layers to one global (six KV cache groups of one layer) and
Gemma 2 with four alternating layers (two groups of two: a block id stands for a
page in each of two layers). Windows of 8 tokens, blocks of 4, prompts of up to 40
tokens: local layers drop blocks at every chunk. A planted bug (a block dropped one
block early) must break the parity, so the parity is the test of the freeing rule
(tests/core/test_scheduler.py's simulated runner catches it on random workloads too).
"""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.core.kv_cache_manager import KVCacheManager
from tests.engine.hf_reference import hf_greedy, hf_prompt_logprobs, random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

NEW_TOKENS = 8
CASES = {
    "gemma3-five-local-one-global": dict(
        arch="gemma3", num_hidden_layers=6, sliding_window=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                         "full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    "gemma2-four-alternating": dict(
        arch="gemma2", num_hidden_layers=4, sliding_window=8, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, query_pre_attn_scalar=24, tie_word_embeddings=True),
}
# num_kv_blocks: the memory of 10 blocks of every layer, 60 block ids for Gemma 3's
# one-layer groups and 20 for Gemma 2's two-layer ones; too few for the workload at
# once, so requests get preempted.
ENGINE = dict(dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=4, token_buckets=[16], request_buckets=[4], seed=0,
              enable_prefix_caching=True, num_kv_blocks=10, precompile=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

pytestmark = pytest.mark.slow  # engines and transformers per model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(checkpoint, prompts sharing a prefix, transformers' greedy tokens, its prompt
    logprobs) of one model."""
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param),
                                     **CASES[request.param])
    vocab = checkpoint_vocab_size(model_dir)
    shared = random_prompts(vocab, [24], seed=3)[0]
    tails = random_prompts(vocab, [16, 9, 5], seed=4)
    prompts = [shared + tails[0], shared + tails[1], tails[2]]
    return (model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS)[0],
            hf_prompt_logprobs(model_dir, prompts))


def run_workload(llm: LLM, prompts: list[list[int]], runs: tuple[SamplingParams, ...]
                 ) -> tuple[list, list, tuple]:
    """The prompts once per `runs` entry (the second request shares the first one's
    prefix: hits); returns each run's outputs, per scheduled step the blocks each group
    of the longest request held, and the groups' windows."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    held: list[list[int]] = []
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        counts = [sched.kv_cache_manager.num_held_blocks(r.request_id) for r in sched.running]
        if counts:
            held.append(max(counts))
        return out

    sched.schedule = recording_schedule
    outs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for params in runs]
    return outs, held, sched.kv_cache_manager.windows


def check_parity(llm: LLM, case, with_prompt_logprobs: bool) -> None:
    """Transformers' tokens (twice, the second time with prompt logprobs within 1e-4
    of its), prefix-cache hits and preemptions on the way, and local groups that held
    fewer blocks than the global one."""
    model_dir, prompts, want, want_prompt_lps = case
    runs = (GREEDY,) + ((SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                        ignore_eos=True, prompt_logprobs=1),)
                        if with_prompt_logprobs else ())
    outs, held, windows = run_workload(llm, prompts, runs)
    for run in outs:
        assert [o.outputs[0].token_ids for o in run] == want
    if with_prompt_logprobs:
        for out, prompt, ref in zip(outs[1], prompts, want_prompt_lps, strict=True):
            got = [lp[t].logprob for t, lp in zip(prompt[1:], out.prompt_logprobs[1:],
                                                  strict=True)]
            assert max(abs(g - w) for g, w in zip(got, ref, strict=True)) < 1e-4
    stats = llm.llm_engine.last_stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # The local groups really let go: at 40 tokens the global group holds 10 blocks,
    # a local one at most the window's 2 and a 16-token chunk's 4, plus one.
    assert len(windows) > 1 and windows[0] is None
    longest = max(held, key=lambda h: h[0])
    assert longest[0] >= 10 and all(h <= 7 for h in longest[1:]), longest


def make_llm(model_dir: str, backend: str, tp: int) -> LLM:
    llm = LLM(model_dir, attention_backend=backend, attention_interpret=backend != "xla",
              tensor_parallel_size=tp, **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    groups = runner.kv_groups
    assert groups.is_hybrid and runner.mesh.shape["model"] == tp
    # The memory of 10 blocks of every layer, in block ids of `group_size` layers.
    assert runner.num_kv_blocks == 10 * len(groups.layer_group) // groups.group_size + 1
    return llm


def test_sliding_window_groups_keep_greedy_and_prompt_logprob_parity(case):
    check_parity(make_llm(case[0], "xla", 1), case, with_prompt_logprobs=True)


@pytest.mark.parametrize("case", ["gemma2-four-alternating"], indirect=True)
@pytest.mark.parametrize("backend,tp", [("pallas_tpu", 1), ("pallas_gpu", 1), ("xla", 2)])
def test_two_layer_groups_keep_greedy_parity_on_pallas_bodies_and_at_tp2(case, backend, tp):
    """Gemma 2's groups of two layers: the second layer of each reads its pages at a
    page offset of one pool's worth, through every body and under shard_map."""
    check_parity(make_llm(case[0], backend, tp), case, with_prompt_logprobs=False)


@pytest.mark.parametrize("case", ["gemma3-five-local-one-global"], indirect=True)
def test_a_block_dropped_one_block_early_breaks_the_parity(case, monkeypatch):
    """The planted bug: the local groups let go of the oldest block their next query
    still reads. Other KV then lands in it, and the prompt logprobs (or tokens) move
    away from transformers'. (A dropped block is handed out again only once the free
    queue reaches it: Gemma 3's five local groups churn through the pool fast enough
    for that to happen within the window; Gemma 2's one local group does not.)"""
    real = KVCacheManager._drop_out_of_window

    def one_block_early(self, request):
        request.num_computed_tokens += self.block_size  # as if a block further on
        try:
            real(self, request)
        finally:
            request.num_computed_tokens -= self.block_size

    monkeypatch.setattr(KVCacheManager, "_drop_out_of_window", one_block_early)
    model_dir, prompts, want, want_prompt_lps = case
    llm = LLM(model_dir, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst = max(abs(lp[t].logprob - w) for out, prompt, ref in zip(outs, prompts,
                                                                   want_prompt_lps, strict=True)
                for t, lp, w in zip(prompt[1:], out.prompt_logprobs[1:], ref, strict=True))
    assert [o.outputs[0].token_ids for o in outs] != want or worst > 1e-3
