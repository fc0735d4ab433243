"""Step buckets: what the engine compiles for, from the flags."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ParameterError
from jaxllm.worker.buckets import Buckets


def test_request_buckets_above_max_num_seqs_are_capped_at_it():
    b = Buckets.make(256, 32, 128, 16, [64, 256], [8, 64, 512])
    assert b.request_buckets == (8, 32)
    with pytest.raises(ParameterError, match="request_buckets"):
        Buckets.make(256, 32, 128, 16, [256], [8, 16])


def test_engine_runs_with_a_request_bucket_larger_than_max_num_seqs():
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[16, 64],
              request_buckets=[8])
    outs = llm.generate(["reverse hello", "sort 5 9 1 7"],
                        SamplingParams(temperature=1.0, seed=0, max_tokens=4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
