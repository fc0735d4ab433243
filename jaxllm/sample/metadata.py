"""What the sampler reads each step: one device pytree, padded to the request bucket.

`SamplingMetadata` is a pytree. Its optional parts are `None` when no
scheduled row needs them, and its static fields are part of the pytree
structure, so every combination is one compiled variant of the sampler:

    mode           all_greedy | random | random + top-k/top-p    (3)
    penalties      None | present                                (2)
    logit_adjust   None | present                                (2)
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

from jaxllm.sampling_params import MAX_LOGPROBS

Array = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Penalties:
    """vLLM's repetition / frequency / presence penalties for `[R]` rows."""

    repetition: Array  # [R] f32, 1.0 = off
    frequency: Array  # [R] f32, 0.0 = off
    presence: Array  # [R] f32, 0.0 = off
    output_counts: Array  # [R, V] i32: times each token was generated so far
    prompt_mask: Array  # [R, V] bool: token occurs in the prompt


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
    penalties: Penalties | None = None
    # Added to the raw logits: logit_bias, -inf outside allowed_token_ids,
    # -inf on banned bad-word tokens and on stop tokens before min_tokens.
    logit_adjust: Array | None = None  # [R, V] f32
    # Structured outputs: packed allowed tokens, bit j of word i = token 32 i + j
    # (all ones on unconstrained and padding rows).
    token_bitmask: Array | None = None  # [R, ceil(V / 32)] i32
    num_logprobs: int = field(default=0, metadata=dict(static=True))
    all_greedy: bool = field(default=False, metadata=dict(static=True))
    use_top_k_top_p: bool = field(default=False, metadata=dict(static=True))


def variant_metadata(padded_size: int, vocab_size: int,
                     device_put: Callable[[Any], Any] | None = None,
                     out_index: Array | None = None) -> Iterator[SamplingMetadata]:
    """One dummy `SamplingMetadata` per compiled variant (for compiling ahead of serving);
    `device_put` as `SamplingRows.device_put` and `out_index` as the runner's (the
    arrays' shapes and placement are part of what a compiled variant expects)."""
    R, V = padded_size, vocab_size
    put = device_put or (lambda x: x)
    penalties = Penalties(np.ones(R, np.float32), np.zeros(R, np.float32),
                          np.zeros(R, np.float32), np.zeros((R, V), np.int32),
                          np.zeros((R, V), bool))
    modes = ((True, False), (False, False), (False, True))
    bitmask = np.full((R, -(-V // 32)), -1, np.int32)
    for (all_greedy, tktp), pen, adj, mask, nlp in itertools.product(
            modes, (None, penalties), (None, np.zeros((R, V), np.float32)), (None, bitmask),
            (0, MAX_LOGPROBS)):
        yield SamplingMetadata(
            *put((np.ones(R, np.float32), np.zeros(R, np.int32), np.ones(R, np.float32),
                  np.zeros(R, np.float32), np.full(R, all_greedy), np.zeros((R, 2), np.uint32))),
            out_index=np.zeros(R, np.int32) if out_index is None else out_index,
            penalties=pen, logit_adjust=adj, token_bitmask=mask, num_logprobs=nlp,
            all_greedy=all_greedy, use_top_k_top_p=tktp)
