"""The ngram proposer: drafts are what followed the latest earlier occurrence of the
context's longest recurring suffix."""

import numpy as np

from jaxllm.spec_decode.ngram import propose_ngram


def drafts(tokens, k=3, lo=1, hi=3):
    return propose_ngram(np.array(tokens, np.int32), k, lo, hi).tolist()


def test_the_longest_matching_suffix_wins_and_its_latest_occurrence_is_copied():
    # Suffix [1, 2] occurs at 0 (then 3) and at 4 (then 7); [9, 1, 2] at 3 (then 7).
    assert drafts([1, 2, 3, 9, 1, 2, 7, 5, 9, 1, 2]) == [7, 5, 9]
    assert drafts([1, 2, 3, 4, 1, 2], hi=2) == [3, 4, 1]


def test_drafts_stop_at_the_context_end_and_need_a_match_of_at_least_min():
    assert drafts([5, 6, 5]) == [6, 5]
    assert drafts([5, 6, 7, 8]) == []
    assert drafts([1, 2, 9, 2], lo=2) == []
    assert drafts([4]) == []
