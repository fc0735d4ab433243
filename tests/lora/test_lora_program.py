"""What multi-LoRA adds to the step's forward program: per adapted projection two
products and two weight arguments, and nothing that runs as a loop or copies per part.

Every operation of the forward is a kernel to launch on a GPU, from the host, each
step; the adapters' term must not multiply them per projection part or per
sequential search step (tests cannot time the device, so they count)."""

from __future__ import annotations

import jax
import pytest

from jaxllm import LLM
from tests.models.tiny_checkpoints import make_tiny_checkpoint

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=8, token_buckets=[4, 32], request_buckets=[4], seed=0,
              precompile=False)
OPS = ("dot_general", "scan", "while", "concatenate", "slice")


def _count(jaxpr, counts: dict[str, int]) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in counts:
            counts[eqn.primitive.name] += 1
        for value in eqn.params.values():  # nested programs: each call site counts
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _count(inner, counts)


def _forward_ops(llm: LLM, tokens: int) -> dict[str, int]:
    """How many of each of OPS the runner's forward for a bucket of `tokens` runs."""
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    programs = runner.programs
    closed = jax.make_jaxpr(programs.forward_core)(runner.state, runner.kv_cache,
                                             programs.dummy_inputs(tokens), runner._no_prev,
                                             *programs.lora_args)
    counts = dict.fromkeys(OPS, 0)
    _count(closed.jaxpr, counts)
    return counts


@pytest.mark.slow
def test_lora_forward_adds_two_products_per_projection_and_no_loop_or_per_part_copy(
        tmp_path):
    base = make_tiny_checkpoint(tmp_path, arch="llama", num_hidden_layers=3)
    plain = LLM(base, **ENGINE)
    lora = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, **ENGINE)
    runner = lora.llm_engine.engine_core.engine_core.model_runner
    projections = len(runner.lora.linears)
    assert projections == 4 * 3  # qkv, o, gate_up, down in each of 3 layers
    for tokens in (4, 32):  # one row per request (decode), and the last layer on rows
        without, with_lora = _forward_ops(plain, tokens), _forward_ops(lora, tokens)
        added = {op: with_lora[op] - without[op] for op in OPS}
        assert added["dot_general"] == 2 * projections, added
        # The rows' slots are not found by a search loop.
        assert added["scan"] == 0 and added["while"] == 0, added
        # No per-part slice or concatenation: the slot table's one padding row at most.
        assert added["concatenate"] <= 1 and added["slice"] <= 1, added
    # Two weight arguments per projection (A, and B with a fused projection's parts stacked).
    assert len(runner.lora.indices) == 2 * projections

