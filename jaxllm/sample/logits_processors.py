"""Logits processors: one sampling feature each, host rows in, a device `apply` out.

The shape of vLLM v1's `LogitsProcessor`: a processor keeps per-row state that
follows the persistent batch (`add` when a request enters a row, `remove`,
`move` when rows condense), hands the sampler its arguments for a batch of
rows (`batch_args`, numpy, neutral on rows that do not use it and on padding;
built when the batch's rows change, not every step), and `apply`s them to
the logits on the device. A new feature is one more class in `PROCESSORS`.

Each processor sits in one of two groups, which are the sampler's compiled
variants (see metadata.py): `fixed` (arguments that never change while the
request runs: logit_bias, allowed_token_ids) and `history` (reads the
request's outputs so far, from the device: min_tokens through the output
index, bad words and penalties through output_state.py's tables). A group
is present when some row of the step uses one of its processors, and then
carries every processor of it; so features add no compiled variants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sample.output_state import WINDOW, OutputTables, pack_ids, unpack_bits
from jaxllm.sampling_params import MAX_BAD_WORDS, SamplingParams


class LogitsProcessor:
    """Per-row host state of one feature, and its device application."""

    group: ClassVar[str]  # "fixed" | "history"
    reads_outputs: ClassVar[bool] = False  # needs output_state.py's tables for its rows

    def __init__(self, max_num_reqs: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.rows: list[Any] = [None] * max_num_reqs  # the row's data; None: unused

    def row_data(self, params: SamplingParams, prompt_token_ids: Sequence[int]) -> Any:
        """What the processor keeps for a request, or None when it does not use it."""
        raise NotImplementedError

    def add(self, row: int, params: SamplingParams, prompt_token_ids: Sequence[int]) -> bool:
        """Takes the request in `row`; whether it uses this processor."""
        self.rows[row] = self.row_data(params, prompt_token_ids)
        return self.rows[row] is not None

    def remove(self, row: int) -> None:
        self.rows[row] = None

    def move(self, src: int, dst: int) -> None:
        self.rows[dst], self.rows[src] = self.rows[src], None

    def used(self, rows: np.ndarray) -> bool:
        return any(self.rows[r] is not None for r in rows.tolist())

    def batch_args(self, rows: np.ndarray, padded_size: int) -> Any:
        """Its arguments for batch rows `rows` padded to `padded_size` (numpy pytree)."""
        raise NotImplementedError

    @staticmethod
    def apply(logits: jax.Array, args: Any, out_index: jax.Array,
              history: tuple[jax.Array, OutputTables] | None) -> jax.Array:
        """The processed `[R, V]` f32 logits; `out_index` `[R]` each row's output index,
        `history` the table row of each batch row and the output tables."""
        raise NotImplementedError


def _ids(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids, np.int64).reshape(-1)
    return arr[(arr >= 0) & (arr < vocab_size)]


def _check_ids(ids: np.ndarray, vocab_size: int, name: str) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name}: token ids must be in [0, {vocab_size})")
    return ids


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a fixed value added to chosen tokens' logits."""

    group = "fixed"

    def row_data(self, params, prompt_token_ids):
        if not params.logit_bias:
            return None
        ids = np.fromiter(params.logit_bias.keys(), np.int64)
        return (_check_ids(ids, self.vocab_size, "logit_bias"),
                np.fromiter(params.logit_bias.values(), np.float32))

    def batch_args(self, rows, padded_size):
        bias = np.zeros((padded_size, self.vocab_size), np.float32)
        for j, r in enumerate(rows.tolist()):
            if (data := self.rows[r]) is not None:
                bias[j, data[0]] += data[1]
        return bias

    @staticmethod
    def apply(logits, args, out_index, history):
        return logits + jnp.asarray(args, jnp.float32)


class AllowedTokens(LogitsProcessor):
    """allowed_token_ids: -inf on every other token."""

    group = "fixed"

    def row_data(self, params, prompt_token_ids):
        if not params.allowed_token_ids:
            return None
        return _check_ids(np.asarray(params.allowed_token_ids, np.int64), self.vocab_size,
                          "allowed_token_ids")

    def batch_args(self, rows, padded_size):
        bits = np.full((padded_size, -(-self.vocab_size // 32)), -1, np.int32)
        for j, r in enumerate(rows.tolist()):
            if (data := self.rows[r]) is not None:
                bits[j] = pack_ids(data, self.vocab_size)
        return bits

    @staticmethod
    def apply(logits, args, out_index, history):
        return jnp.where(unpack_bits(args, logits.shape[-1]), logits, -jnp.inf)


class MinTokens(LogitsProcessor):
    """min_tokens: the stop tokens are -inf until that many outputs exist."""

    group = "history"

    def row_data(self, params, prompt_token_ids):
        stop_ids = params.all_stop_token_ids
        stop_ids = _ids(params.stop_token_ids or [] if stop_ids is None else stop_ids,
                        self.vocab_size)
        if not params.min_tokens or not stop_ids.size:
            return None
        return params.min_tokens, pack_ids(stop_ids, self.vocab_size)

    def batch_args(self, rows, padded_size):
        min_tokens = np.zeros(padded_size, np.int32)
        stop_bits = np.zeros((padded_size, -(-self.vocab_size // 32)), np.int32)
        for j, r in enumerate(rows.tolist()):
            if (data := self.rows[r]) is not None:
                min_tokens[j], stop_bits[j] = data
        return min_tokens, stop_bits

    @staticmethod
    def apply(logits, args, out_index, history):
        min_tokens, stop_bits = args
        before = (out_index[:logits.shape[0]] < min_tokens)[:, None]
        return jnp.where(before & unpack_bits(stop_bits, logits.shape[-1]), -jnp.inf, logits)


class BadWords(LogitsProcessor):
    """bad_words: a word's last token is -inf where the outputs end with the rest of it.

    The words of a row are `[MAX_BAD_WORDS, WINDOW + 1]`: the prefix right-aligned
    against the output window (`_ANY` before it), then the banned token (-1:
    no word). A prefix token outside the vocabulary can never match.
    """

    group = "history"
    reads_outputs = True
    _ANY, _NEVER = -2, -3

    def row_data(self, params, prompt_token_ids):
        # A bad word whose last token is outside the model's vocabulary bans nothing.
        words = [w for w in params.bad_words_token_ids or () if w and 0 <= w[-1] < self.vocab_size]
        if not words:
            return None
        table = np.full((MAX_BAD_WORDS, WINDOW + 1), self._ANY, np.int32)
        table[:, -1] = -1
        for i, w in enumerate(words):
            prefix = np.asarray(w[:-1], np.int64)
            prefix = np.where((prefix >= 0) & (prefix < self.vocab_size), prefix, self._NEVER)
            table[i, WINDOW - prefix.size:WINDOW] = prefix
            table[i, -1] = w[-1]
        return table

    def batch_args(self, rows, padded_size):
        table = np.full((padded_size, MAX_BAD_WORDS, WINDOW + 1), -1, np.int32)
        for j, r in enumerate(rows.tolist()):
            if (data := self.rows[r]) is not None:
                table[j] = data
        return table

    @staticmethod
    def apply(logits, args, out_index, history):
        rows, tables = history
        words = jnp.asarray(args)
        window = tables.window[rows][:, None, :]  # [R, 1, WINDOW]
        prefix = words[:, :, :WINDOW]
        match = jnp.all((prefix == BadWords._ANY) | (prefix == window), axis=-1)
        banned = jnp.where(match & (words[:, :, WINDOW] >= 0), words[:, :, WINDOW],
                           logits.shape[-1])
        r = jnp.arange(logits.shape[0])[:, None]
        return logits.at[r, banned].set(-jnp.inf, mode="drop")


class Penalties(LogitsProcessor):
    """vLLM's penalties: repetition on prompt or output tokens, then frequency and presence."""

    group = "history"
    reads_outputs = True

    def row_data(self, params, prompt_token_ids):
        if not params.needs_penalties:
            return None
        return (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)

    def batch_args(self, rows, padded_size):
        knobs = np.zeros((3, padded_size), np.float32)
        knobs[0] = 1.0
        for j, r in enumerate(rows.tolist()):
            if (data := self.rows[r]) is not None:
                knobs[:, j] = data
        return knobs

    @staticmethod
    def apply(logits, args, out_index, history):
        rows, tables = history
        counts = tables.counts[rows]
        seen = unpack_bits(tables.prompt_bits[rows], logits.shape[-1]) | (counts > 0)
        knobs = jnp.asarray(args)
        rep, freq, pres = knobs[0][:, None], knobs[1][:, None], knobs[2][:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - freq * counts.astype(jnp.float32)
        return logits - pres * (counts > 0).astype(jnp.float32)


# In the order they apply: what vLLM applies, before the token bitmask.
PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    LogitBias, AllowedTokens, MinTokens, BadWords, Penalties)


def apply_group(logits: jax.Array, group: str, args: tuple, out_index: jax.Array,
                history: tuple[jax.Array, OutputTables] | None) -> jax.Array:
    """Every processor of `group`, in order, with its arguments from `args`."""
    procs = [p for p in PROCESSORS if p.group == group]
    for proc, a in zip(procs, args, strict=True):
        logits = proc.apply(logits, a, out_index, history)
    return logits
