"""The engine core's view of one request: its tokens, progress and status."""

from __future__ import annotations

import enum
import itertools
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jaxllm.core.block_hash import BlockHash, BlockHasher, lora_hash_root
from jaxllm.core.messages import EngineCoreRequest, FinishReason
from jaxllm.lora.request import LoRARequest
from jaxllm.sampling_params import PoolingParams, SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    def is_finished(self) -> bool:
        # Written as a method so both `status.is_finished()` and vLLM's
        # `RequestStatus.is_finished(status)` read naturally.
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class _BatchCounter:
    """An int attribute of a Request that lives in its RunningBatch's array `column`
    while the request runs (`batch_index >= 0`), and in `private` otherwise."""

    def __init__(self, column: str, private: str):
        self.column, self.private = column, private

    def __get__(self, request: Request | None, owner: type) -> int:
        if request is None:
            return self  # type: ignore[return-value]
        i = request.batch_index
        if i < 0:
            return getattr(request, self.private)
        return int(getattr(request._batch, self.column)[i])

    def __set__(self, request: Request, value: int) -> None:
        i = request.batch_index
        if i < 0:
            setattr(request, self.private, value)
        else:
            getattr(request._batch, self.column)[i] = value


class OutputTokens(Sequence[int]):
    """A request's generated tokens: a read-only view of `all_token_ids` past the prompt.

    A decode step appends each request's token to one list, not two (the append
    is most of what is left of a token's Python work in the step)."""

    __slots__ = ("_all", "_start")

    def __init__(self, all_token_ids: list[int], start: int):
        self._all, self._start = all_token_ids, start

    def __len__(self) -> int:
        return len(self._all) - self._start

    def __getitem__(self, i: int | slice):  # type: ignore[override]
        if isinstance(i, slice):
            return self._all[self._start:][i]
        n = len(self._all) - self._start
        if not -n <= i < n:
            raise IndexError("output token index out of range")
        return self._all[self._start + i if i >= 0 else i]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._all, self._start, None)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, OutputTokens)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (a view of a list that grows)

    def __repr__(self) -> str:
        return f"OutputTokens({self._all[self._start:]!r})"


class Request:
    """One generation or pooling request as the scheduler tracks it.

    `all_token_ids` is the prompt followed by the generated tokens
    (`output_token_ids` views the latter);
    `num_computed_tokens` of them have their KV in the cache. With a block
    hasher attached, `block_hashes` holds the chained hash of every full block
    of `all_token_ids` and grows as tokens are appended.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None,
                 pooling_params: PoolingParams | None = None,
                 eos_token_id: int | None = None, arrival_time: float | None = None,
                 priority: int = 0, block_hasher: BlockHasher | None = None,
                 lora_request: LoRARequest | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if sampling_params is None and pooling_params is None:
            sampling_params = SamplingParams()
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request else 0
        # The parent of its first block's hash: an adapter's blocks never match the
        # base model's or another adapter's (the prefix cache is keyed by adapter).
        self.hash_root: BlockHash | None = (
            None if lora_request is None else lora_hash_root(lora_request.lora_int_id,
                                                        lora_request.lora_name))
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids = OutputTokens(self.all_token_ids, self.num_prompt_tokens)
        # While the request runs, these two counters live in the scheduler's
        # RunningBatch arrays (see the properties below).
        self.batch_index = -1  # position in that batch, -1 when not running
        # The RunningBatch holding them (untyped: running_batch.py imports this module).
        self._batch: Any = None
        self._num_computed_tokens = 0
        self._num_output_placeholders = 0
        # Prefix-cache hit (tokens) at the first schedule; -1 until then, as in vLLM.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Prompt positions below this have had their prompt logprobs scored (in a
        # run cut short by preemption); the resumed run does not score them again.
        self.prompt_logprobs_from = 0
        # Speculative decoding: the drafts proposed after its last step, for the next.
        self.spec_token_ids: list[int] = []

        if pooling_params is not None:
            self.max_tokens = 1  # a pooling request generates nothing; it ends after its prompt
        elif sampling_params is not None and sampling_params.max_tokens is not None:
            self.max_tokens = sampling_params.max_tokens
        else:
            self.max_tokens = sys.maxsize  # capped by max_model_len instead

        self.block_hashes: list[BlockHash] = []
        self._block_hasher: BlockHasher | None = None
        if block_hasher is not None:
            self.attach_block_hasher(block_hasher)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest,
                                 block_hasher: BlockHasher | None = None) -> Request:
        return cls(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                   sampling_params=req.sampling_params, pooling_params=req.pooling_params,
                   eos_token_id=req.eos_token_id, arrival_time=req.arrival_time,
                   priority=req.priority, block_hasher=block_hasher,
                   lora_request=req.lora_request)

    def attach_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Starts hashing full blocks (the scheduler does this when prefix caching is on)."""
        self._block_hasher = block_hasher
        self._hash_block_size = getattr(block_hasher, "block_size", 1)
        self.block_hashes.extend(block_hasher(self))

    @property
    def has_block_hasher(self) -> bool:
        return self._block_hasher is not None

    # Tokens of `all_token_ids` whose KV is in the cache.
    num_computed_tokens = _BatchCounter("computed", "_num_computed_tokens")
    # Tokens scheduled to be sampled whose ids have not come back yet (at most
    # one: async scheduling runs one step ahead).
    num_output_placeholders = _BatchCounter("pending", "_num_output_placeholders")

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        self.hash_new_blocks()

    def check_stop(self, max_request_tokens: int) -> bool:
        """Applies the stop conditions after one appended token; sets status and stop_reason."""
        params = self.sampling_params
        if params is None:
            return False
        tokens = self.all_token_ids  # (output_token_ids is a view of it)
        last = tokens[-1]
        num_output = self.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_output >= self.max_tokens or len(tokens) >= max_request_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def hashed_by(self, block_hasher: BlockHasher) -> bool:
        return self._block_hasher is block_hasher

    def hash_new_blocks(self) -> None:
        """Hashes the blocks that filled up since the last call (most appends fill none)."""
        if (self._block_hasher is not None and len(self.all_token_ids)
                >= (len(self.block_hashes) + 1) * self._hash_block_size):
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return self.status.is_finished()

    def get_finished_reason(self) -> FinishReason | None:
        return self.status.finish_reason()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
