"""The sampling programs at tensor_parallel_size=2 read vocab-parallel logits without
gathering them: each device draws over its own vocab shard, and only each row's best
candidate per device (`[R, tp]`) crosses devices, never the `[R, vocab]` logits.

The compiled programs' HLO is read for its collectives, for greedy rows and for
random ones (temperature, min-p: the one-program sampler the runner calls on a
step without top-k / top-p). The demo model's 48-id vocabulary splits over the 2
devices, so the logits are sharded and some collective must appear.
"""

from __future__ import annotations

import re

import pytest

from jaxllm import LLM
from jaxllm.sample.metadata import variant_metadata
from jaxllm.sample.staged import is_plain

pytestmark = pytest.mark.slow  # an engine at tp=2 and its sampling programs compile

TP = 2
_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|reduce-scatter|"
                         r"all-to-all|collective-permute)(?:-start)?\(")


@pytest.fixture(scope="module")
def runner():
    llm = LLM(None, tensor_parallel_size=TP, dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16, block_size=8, token_buckets=[16], request_buckets=[4],
              seed=0, precompile=False)
    yield llm.llm_engine.engine_core.engine_core.model_runner
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("mode", ["greedy", "random"])
def test_sampling_program_at_tp2_gathers_per_device_candidates_not_the_logits(runner, mode):
    programs = runner.programs
    runner.kv_cache, _, last_hidden, out_index = programs.run_forward(
        runner.state, runner.kv_cache, programs.dummy_inputs(16), runner._no_prev)
    s, vocab = runner.buckets.max_num_seqs, runner.vocab_size
    assert vocab % TP == 0  # the logits head is split over the vocab
    md = next(md for md in variant_metadata(s, vocab, runner.input_batch.sampling.device_put,
                                            out_index)
              if is_plain(md) and not md.use_top_k_top_p
              and md.all_greedy == (mode == "greedy"))
    hlo = programs.sample_fn.lower(programs.head, last_hidden, md, size=s).compile().as_text()
    collectives = [(kind, [int(d) for d in dims.split(",") if d])
                   for _, dims, kind in _COLLECTIVE.findall(hlo)]
    assert collectives, "no collective: the logits were not vocab-parallel"
    for kind, dims in collectives:
        assert vocab not in dims and vocab // TP not in dims, (kind, dims)
        assert kind in ("all-gather", "all-reduce") and dims in ([s, TP], [s]), (kind, dims)
    assert sum(kind == "all-gather" for kind, _ in collectives) >= 2  # best value and its id
