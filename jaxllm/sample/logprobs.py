"""Logprobs as host lists: the form they take from the model runner to the frontend.

A msgspec Struct, so the engine core's messages carry it across ZMQ as it is
(core/messages.py names it); it lives here, below the worker and the
scheduler, so that neither imports the engine to name it.
"""

from __future__ import annotations

import msgspec


# Made by the hundred every step and holding lists of numbers only (no
# reference cycle): gc=False keeps it out of the cyclic collector's generations.
class LogprobsLists(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Logprobs of several positions.

    Row i: `token_ids[i][0]` is the chosen (sampled or prompt) token and the
    rest are the top-k in descending order; `logprobs[i]` aligns with it;
    `ranks[i]` is the chosen token's rank in the full distribution (1 = best).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, stop: int) -> LogprobsLists:
        return LogprobsLists(self.token_ids[start:stop], self.logprobs[start:stop],
                             self.ranks[start:stop])
