"""The ngram (prompt lookup) proposer: drafts copied from where the context's tail recurs.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens
of a request's context are looked up in the rest of it; at the first n that
matches, the tokens that followed its latest earlier occurrence are the
drafts (up to k of them). A context that repeats itself (code, quotes,
extraction) gets long accepted runs; one that does not gets no drafts.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to `k` draft tokens for the context `tokens` `[L]` (empty when nothing recurs)."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting before the suffix's own start, so a continuation exists.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]
