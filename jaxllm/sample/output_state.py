"""What the sampler knows of each request's own outputs, kept on the device by row.

Penalties and multi-token bad words read a request's previous outputs. Held on
the host, they would make every such step wait for the one in flight; here
they are device tables indexed by the persistent batch row (InputBatch's),
updated on the device from each step's sampled ids, so async scheduling stays
on:

    counts       [S, V] i32   times each token was generated (penalties)
    window       [S, L] i32   the last L outputs, oldest first, -1 where none (bad words)
    prompt_bits  [S, V/32] i32  the prompt's tokens, packed (repetition penalty)

Only rows whose request reads them ("tracked" rows) hold meaningful values; a
request's row is filled when it enters the batch (a resumed request brings
its outputs). Row moves and removals are kept on the host as `origin` (the
table row each batch row's values sit in) and applied as one fixed-shape
gather before the tables are next read, so no step compiles anew.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sampling_params import MAX_BAD_WORD_TOKENS

# Outputs a multi-token bad word may look back on: its length less one.
WINDOW = MAX_BAD_WORD_TOKENS - 1


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class OutputTables:
    counts: jax.Array  # [S, V] i32
    window: jax.Array  # [S, WINDOW] i32
    prompt_bits: jax.Array  # [S, ceil(V / 32)] i32


def pack_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """`[ceil(V / 32)]` int32 words with bit j of word i set for token 32 i + j in `ids`."""
    words = np.zeros(-(-vocab_size // 32), np.uint32)
    ids = np.asarray(ids, np.int64)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def unpack_bits(bits: jax.Array, vocab_size: int) -> jax.Array:
    """`[R, V]` bool from packed `[R, ceil(V / 32)]` words, on the device."""
    one = jnp.right_shift(jnp.asarray(bits, jnp.int32)[:, :, None],
                          jnp.arange(32, dtype=jnp.int32)) & 1
    return one.reshape(one.shape[0], -1)[:, :vocab_size].astype(bool)


@functools.partial(jax.jit, donate_argnums=(0,))
def _permute(tables: OutputTables, origin: jax.Array) -> OutputTables:
    """Row r takes row `origin[r]`'s values (-1: emptied)."""
    keep = origin >= 0
    src = jnp.maximum(origin, 0)

    def take(t, empty):
        return jnp.where(keep.reshape(-1, *([1] * (t.ndim - 1))), t[src], empty)

    return OutputTables(take(tables.counts, 0), take(tables.window, -1),
                        take(tables.prompt_bits, 0))


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_row(tables: OutputTables, row: jax.Array, counts: jax.Array, window: jax.Array,
             prompt_bits: jax.Array) -> OutputTables:
    return OutputTables(tables.counts.at[row].set(counts), tables.window.at[row].set(window),
                        tables.prompt_bits.at[row].set(prompt_bits))


@functools.partial(jax.jit, donate_argnums=(0,))
def _record(tables: OutputTables, rows: jax.Array, token_ids: jax.Array) -> OutputTables:
    """Adds `token_ids[j]` to table row `rows[j]` (rows out of range: nothing)."""
    tok = token_ids[:rows.shape[0]].astype(jnp.int32)
    counts = tables.counts.at[rows, tok].add(1, mode="drop")
    shifted = jnp.concatenate([tables.window[rows, 1:], tok[:, None]], axis=1)
    return OutputTables(counts, tables.window.at[rows].set(shifted, mode="drop"),
                        tables.prompt_bits)


class OutputState:
    """The device tables of `max_num_reqs` rows, and the host's view of their rows."""

    def __init__(self, max_num_reqs: int, vocab_size: int):
        self.max_num_reqs, self.vocab_size = max_num_reqs, vocab_size
        self.tracked = np.zeros(max_num_reqs, bool)
        self._origin = np.arange(max_num_reqs, dtype=np.int32)
        self._pending: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._tables: OutputTables | None = None
        self._dirty = False  # a row changed since the last flush
        self.device_put: Callable[[Any], Any] | None = None  # set before first use

    @staticmethod
    def device_bytes(max_num_reqs: int, vocab_size: int) -> int:
        return max_num_reqs * 4 * (vocab_size + WINDOW + -(-vocab_size // 32))

    @property
    def tables(self) -> OutputTables:
        """The tables as the sampler reads them now (after `flush`)."""
        if self._tables is None:
            s, v = self.max_num_reqs, self.vocab_size
            host = OutputTables(np.zeros((s, v), np.int32), np.full((s, WINDOW), -1, np.int32),
                                np.zeros((s, -(-v // 32)), np.int32))
            self._tables = (self.device_put or jax.device_put)(host)
        return self._tables

    # ---- row lifecycle (host only; applied on the device by `flush`) ----------

    def track(self, row: int, prompt_token_ids: Sequence[int],
              output_token_ids: Sequence[int]) -> None:
        """Fills `row` for a request that reads its outputs (a resumed one passes them)."""
        v = self.vocab_size
        outs = np.asarray(output_token_ids, np.int64).reshape(-1)
        outs = outs[(outs >= 0) & (outs < v)]
        prompt = np.asarray(prompt_token_ids, np.int64).reshape(-1)
        window = np.full(WINDOW, -1, np.int32)
        if outs.size:
            last = outs[-WINDOW:]
            window[WINDOW - last.size:] = last
        self.tracked[row] = True
        self._origin[row] = -1
        self._dirty = True
        self._pending[row] = (np.bincount(outs, minlength=v).astype(np.int32), window,
                              pack_ids(prompt[(prompt >= 0) & (prompt < v)], v))

    def untrack(self, row: int) -> None:
        self._dirty = True
        self.tracked[row] = False
        self._origin[row] = -1
        self._pending.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        """The request in `src` now sits in `dst`; `src` is left empty."""
        self.tracked[dst], self._origin[dst] = self.tracked[src], self._origin[src]
        if (pending := self._pending.pop(src, None)) is not None:
            self._pending[dst] = pending
        else:
            self._pending.pop(dst, None)
        self.untrack(src)

    # ---- device side ---------------------------------------------------------

    def flush(self) -> None:
        """Applies the row changes since the last flush to the device tables."""
        if not self._dirty:
            return
        self._dirty = False
        rows = np.flatnonzero(self.tracked)
        moved = self._origin[rows] != rows
        if moved.any() and not all(int(r) in self._pending for r in rows[moved]):
            self._tables = _permute(self.tables, self._origin)
        self._origin = np.arange(self.max_num_reqs, dtype=np.int32)
        for row, (counts, window, bits) in self._pending.items():
            self._tables = _set_row(self.tables, np.int32(row), counts, window, bits)
        self._pending.clear()

    def record(self, rows: np.ndarray, token_ids: jax.Array) -> None:
        """Records `token_ids[j]` as the next output of table row `rows[j]` (`[R]`;
        `max_num_reqs` or more: no token), on the device."""
        self.flush()
        self._tables = _record(self.tables, rows, token_ids)

    def precompile(self, request_buckets: Sequence[int], token_ids: jax.Array) -> None:
        """Compiles the flush and record programs (with no row to change)."""
        s, v = self.max_num_reqs, self.vocab_size
        # Twice over: the second round takes tables as the programs themselves place them.
        for _ in range(2):
            self._tables = _permute(self.tables, np.arange(s, dtype=np.int32))
            self._tables = _set_row(self.tables, np.int32(0), np.zeros(v, np.int32),
                                    np.full(WINDOW, -1, np.int32), pack_ids(np.zeros(0), v))
            for r in request_buckets:
                self.record(np.full(r, s, np.int32), token_ids)
