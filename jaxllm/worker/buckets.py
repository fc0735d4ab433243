"""The padding policy: the single source of the shapes the jitted step is compiled for.

Token counts pad up to a token bucket (the model forward is compiled once per
token bucket); request counts pad up to a request bucket (logits and the
sampler are compiled once per request bucket). Attention metadata always has
`max_num_seqs` rows so the forward does not depend on the request count.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from jaxllm.errors import ParameterError

_MIN_TOKEN_BUCKET = 16
_MIN_REQUEST_BUCKET = 8


def _geometric(lo: int, hi: int) -> list[int]:
    """lo, 2lo, 4lo, ... then hi itself (so the largest bucket is exactly hi)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return out


@dataclass(frozen=True)
class Buckets:
    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]
    max_num_seqs: int
    max_blocks_per_req: int  # block-table width: ceil(max_model_len / block_size)

    @classmethod
    def make(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
             block_size: int, token_buckets: list[int] | None = None,
             request_buckets: list[int] | None = None) -> Buckets:
        tb = sorted(set(token_buckets or _geometric(
            min(_MIN_TOKEN_BUCKET, max_num_batched_tokens), max_num_batched_tokens)))
        rb = sorted(set(request_buckets or _geometric(
            min(_MIN_REQUEST_BUCKET, max_num_seqs), max_num_seqs)))
        for name, buckets in (("token_buckets", tb), ("request_buckets", rb)):
            if buckets[0] < 1:
                raise ParameterError(name, f"every bucket must be at least 1, got {buckets}")
        if tb[-1] < max_num_batched_tokens:
            raise ParameterError("token_buckets", f"the largest ({tb[-1]}) must cover "
                                 f"max_num_batched_tokens={max_num_batched_tokens}")
        if rb[-1] < max_num_seqs:
            raise ParameterError("request_buckets", f"the largest ({rb[-1]}) must cover "
                                 f"max_num_seqs={max_num_seqs}")
        # No step holds more than max_num_seqs requests, and the per-row state is that
        # tall: a larger bucket is that bucket.
        rb = sorted({min(r, max_num_seqs) for r in rb})
        width = -(-max_model_len // block_size)
        return cls(tuple(tb), tuple(rb), max_num_seqs, width)

    def pad_tokens(self, n: int) -> int:
        return self.token_buckets[bisect.bisect_left(self.token_buckets, n)]

    def pad_requests(self, n: int) -> int:
        return self.request_buckets[bisect.bisect_left(self.request_buckets, n)]

    def padding_waste(self, num_tokens: np.ndarray) -> float:
        """Fraction of computed token rows that are padding, over observed step sizes."""
        padded = np.array([self.pad_tokens(int(n)) for n in num_tokens])
        return float(1.0 - num_tokens.sum() / max(padded.sum(), 1))
