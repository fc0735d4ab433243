"""What the sampler reads each step: one device pytree, padded to the request bucket.

`SamplingMetadata` is a pytree. Its optional parts are `None` when no
scheduled row needs them, and its static fields are part of the pytree
structure, so every combination is one compiled variant of the sampler:

    mode           all_greedy | random | random + top-k/top-p    (3)
    fixed          None | present  (logit_bias, allowed tokens)  (2)
    history        None | present  (min_tokens, bad words,       (2)
                                    penalties)
    token_bitmask  None | present                                (2)
    num_logprobs   0 | MAX_LOGPROBS                              (2)

48 variants per request bucket at most (the runner jits the sampler in stages,
so that far fewer programs are compiled: see staged.py); `variant_metadata` builds a dummy of
each for compiling ahead of serving. The model runner builds the real ones
from its persistent rows (worker/sampling_rows.py); the keys' inputs are
described in rng.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxllm.sample.logits_processors import PROCESSORS
from jaxllm.sample.output_state import OutputState, OutputTables
from jaxllm.sampling_params import MAX_LOGPROBS

Array = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class History:
    """The `history` group's arguments: what reads the requests' outputs so far."""

    rows: Array  # [R] i32: each batch row's row in the output tables
    tables: OutputTables  # output_state.py's, as of this step
    args: tuple  # each history processor's batch_args, in PROCESSORS order


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Sampling inputs of one step, every array padded to the request bucket R.

    Padding rows are greedy with every filter off; their outputs are ignored.
    """

    temperature: Array  # [R] f32 (1.0 on greedy rows)
    top_k: Array  # [R] i32, 0 = off
    top_p: Array  # [R] f32, 1.0 = off
    min_p: Array  # [R] f32, 0.0 = off
    greedy: Array  # [R] bool
    key_base: Array  # [R, 2] u32: each row's key base, high and low 32 bits
    out_index: Array  # [>= R] i32: the output index each row samples (rows past R unused)
    # The logits processors' arguments, by group (logits_processors.py).
    fixed: tuple | None = None  # each fixed processor's batch_args
    history: History | None = None
    # Structured outputs: packed allowed tokens, bit j of word i = token 32 i + j
    # (all ones on unconstrained and padding rows).
    token_bitmask: Array | None = None  # [R, ceil(V / 32)] i32
    num_logprobs: int = field(default=0, metadata=dict(static=True))
    all_greedy: bool = field(default=False, metadata=dict(static=True))
    use_top_k_top_p: bool = field(default=False, metadata=dict(static=True))


def group_args(group: str, padded_size: int, vocab_size: int) -> tuple:
    """A group's arguments with no row using it (every row neutral)."""
    return tuple(p(padded_size, vocab_size).batch_args(np.zeros(0, np.int64), padded_size)
                 for p in PROCESSORS if p.group == group)


def variant_metadata(padded_size: int, vocab_size: int,
                     device_put: Callable[[Any], Any] | None = None,
                     out_index: Array | None = None,
                     tables: OutputTables | None = None) -> Iterator[SamplingMetadata]:
    """One dummy `SamplingMetadata` per compiled variant (for compiling ahead of serving);
    `device_put` as `SamplingRows.device_put`, `out_index` as the runner's and `tables`
    the runner's output tables (the arrays' shapes and placement are part of what a
    compiled variant expects; without `tables`, a dummy of `padded_size` rows)."""
    R, V = padded_size, vocab_size
    put = device_put or (lambda x: x)
    if tables is None:
        state = OutputState(R, V)
        state.device_put = put
        tables = state.tables
    fixed = put(group_args("fixed", R, V))
    history = History(put(np.zeros(R, np.int32)), tables, put(group_args("history", R, V)))
    modes = ((True, False), (False, False), (False, True))
    bitmask = np.full((R, -(-V // 32)), -1, np.int32)
    for (all_greedy, tktp), hist, fix, mask, nlp in itertools.product(
            modes, (None, history), (None, fixed), (None, bitmask), (0, MAX_LOGPROBS)):
        yield SamplingMetadata(
            *put((np.ones(R, np.float32), np.zeros(R, np.int32), np.ones(R, np.float32),
                  np.zeros(R, np.float32), np.full(R, all_greedy), np.zeros((R, 2), np.uint32))),
            out_index=np.zeros(R, np.int32) if out_index is None else out_index,
            fixed=fix, history=hist, token_bitmask=mask, num_logprobs=nlp,
            all_greedy=all_greedy, use_top_k_top_p=tktp)
