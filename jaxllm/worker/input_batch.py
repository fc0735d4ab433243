"""Persistent per-request rows of the model runner.

A request keeps its row from the step it joins until it finishes or is
preempted, so unchanged state (token ids, block table, sampling knobs) is
written once, not rebuilt every step. Rows stay dense: removing a request
moves the last row into the hole. All per-step work over rows is numpy.
"""

from __future__ import annotations

import numpy as np

from jaxllm.core.sched_output import NewRequestData
from jaxllm.sampling_params import PoolingParams, SamplingParams
from jaxllm.spec_decode.policy import can_draft
from jaxllm.worker.sampling_rows import SamplingRows


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 vocab_size: int, num_kv_groups: int = 1):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str] = []
        self.req_id_to_row: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)  # prompt + known outputs
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        # The scheduler's count, as each SchedulerOutput sends it for the step's
        # requests (new or cached); the runner never advances it itself.
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)
        # One table per KV cache group, side by side: group g's in columns
        # [g * max_blocks_per_req, (g + 1) * max_blocks_per_req).
        self.max_blocks_per_req, self.num_kv_groups = max_blocks_per_req, num_kv_groups
        self.block_table = np.zeros((max_num_reqs, num_kv_groups * max_blocks_per_req),
                                    np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)  # per group
        # Async scheduling: the row, in the dispatched step's device output, of
        # the latest token sampled for the request and not yet on the host.
        self.inflight_index = np.full(max_num_reqs, -1, np.int32)
        # Per-row flags, so that per-step code never walks the params objects.
        self.generates = np.zeros(max_num_reqs, bool)  # a request that samples tokens
        self.pools = np.zeros(max_num_reqs, bool)  # an embedding request
        self.wants_prompt_logprobs = np.zeros(max_num_reqs, bool)
        self.prompt_logprobs_from = np.zeros(max_num_reqs, np.int32)  # NewRequestData's
        # Speculative decoding: the request's tokens may be drafted (spec_verify.can_draft).
        self.can_draft = np.zeros(max_num_reqs, bool)
        # Bumped whenever a request changes rows, so that row indices taken at
        # dispatch can be reused at collect when nothing moved in between.
        self.layout_version = 0
        self.sampling = SamplingRows(max_num_reqs, vocab_size)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.pooling: list[PoolingParams | None] = [None] * max_num_reqs

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, new: NewRequestData) -> None:
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError("input batch is full: the scheduler exceeded max_num_seqs")
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        n = len(tokens)
        self.req_ids.append(new.req_id)
        self.req_id_to_row[new.req_id] = row
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.inflight_index[row] = -1
        self.append_blocks(row, new.block_ids)
        self.params[row] = new.sampling_params
        self.pooling[row] = new.pooling_params
        self.generates[row] = new.sampling_params is not None
        self.pools[row] = new.pooling_params is not None
        self.wants_prompt_logprobs[row] = (new.sampling_params is not None and
                                           new.sampling_params.prompt_logprobs is not None)
        self.prompt_logprobs_from[row] = new.prompt_logprobs_from
        self.can_draft[row] = new.pooling_params is None and can_draft(new.sampling_params)
        if new.sampling_params is not None:
            self.sampling.add(row, new.sampling_params, new.prompt_token_ids,
                              new.output_token_ids)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Appends blocks to the row's tables: with G groups, `block_ids` is G equal
        runs, one per group in order (as the scheduler sends them)."""
        start = self.num_blocks[row]
        n = len(block_ids) // self.num_kv_groups
        if self.num_kv_groups == 1:
            self.block_table[row, start:start + n] = block_ids
        else:
            width = self.max_blocks_per_req
            for g in range(self.num_kv_groups):
                at = g * width + start
                self.block_table[row, at:at + n] = block_ids[g * n:(g + 1) * n]
        self.num_blocks[row] = start + n

    def remove(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        self.layout_version += 1
        if self.params[row] is not None:
            self.sampling.remove(row)
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.req_id_to_row[moved] = row
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                        self.num_blocks, self.inflight_index, self.generates, self.pools,
                        self.wants_prompt_logprobs, self.prompt_logprobs_from, self.can_draft):
                arr[row] = arr[last]
            self.block_table[row] = self.block_table[last]
            self.params[row] = self.params[last]
            self.pooling[row] = self.pooling[last]
            if self.params[last] is not None:
                self.sampling.move(last, row)
        self.req_ids.pop()
        self.params[last] = None
        self.pooling[last] = None
        self.generates[last] = self.pools[last] = self.wants_prompt_logprobs[last] = False
        self.can_draft[last] = False

    def write_drafts(self, rows: np.ndarray, drafts: list[list[int]],
                     num_drafts: np.ndarray) -> None:
        """Places each row's draft tokens after its known ones and counts them as known
        (the caller takes them back off `num_tokens` once the step's inputs are packed;
        accepted ones are written again when they come back)."""
        for row, d, start in zip(rows.tolist(), drafts, self.num_tokens[rows].tolist(),
                                 strict=True):
            self.token_ids[row, start:start + len(d)] = d
        self.num_tokens[rows] += num_drafts

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Records one sampled token for each of `rows` (vectorized)."""
        if rows.size == 0:
            return
        pos = self.num_tokens[rows]
        ok = pos < self.max_model_len
        if ok.all():  # the usual case: no masking
            self.token_ids[rows, pos] = token_ids
            self.num_tokens[rows] += 1
        else:
            self.token_ids[rows[ok], pos[ok]] = token_ids[ok]
            self.num_tokens[rows[ok]] += 1
