"""The scheduler's sizes and policies for a random workload, shared by the property tests."""

from __future__ import annotations

from hypothesis import strategies as st


def scheduler_shapes(draw, max_pool_tokens: int, max_num_seqs: int) -> dict:
    """Block size, a small pool (so requests get preempted), budgets, policy, caching,
    request count and abort rate, drawn with `draw`."""
    block_size = draw(st.sampled_from([2, 4]))
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        block_size=block_size,
        num_blocks=draw(st.integers(3, max_pool_tokens // block_size)),
        max_model_len=draw(st.sampled_from([12, 24, 40])),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, max_num_seqs)),
        chunked=draw(st.booleans()),
        threshold=draw(st.sampled_from([0, 0, 3])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        caching=draw(st.sampled_from([True, True, False])),
        num_requests=draw(st.integers(1, 16)),
        abort_rate=draw(st.sampled_from([0.0, 0.05])),
    )
