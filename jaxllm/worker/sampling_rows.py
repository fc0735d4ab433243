"""The model runner's per-request sampling state, kept in persistent numpy rows.

`SamplingRows` keeps every running request's sampling knobs in rows that
`InputBatch` keeps aligned with its own (a request stays in one row across
steps; `move` condenses rows). Each step `make_metadata` gathers the
scheduled rows into a `SamplingMetadata` padded to the request bucket,
vectorized over rows; only rows that need a per-vocab row (penalties, logit
bias, allowed tokens, bad words, min_tokens) are visited one by one. Each
row holds its RNG key base (sample/rng.py); the keys are made on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxllm.sample.metadata import Array, Penalties, SamplingMetadata
from jaxllm.sample.rng import key_base_data
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams


class SamplingRows:
    """Host state of up to `max_num_reqs` request rows, for `vocab_size` tokens."""

    def __init__(self, max_num_reqs: int, vocab_size: int):
        n = max_num_reqs
        self.max_num_reqs, self.vocab_size = n, vocab_size
        # name -> (array, value of an empty row); every row-wise array moves together.
        self._cols: dict[str, tuple[np.ndarray, object]] = {}
        for name, dtype, empty in (
            ("active", bool, False), ("greedy", bool, True), ("temperature", np.float32, 1.0),
            ("top_k", np.int32, 0), ("top_p", np.float32, 1.0), ("min_p", np.float32, 0.0),
            ("seeded", bool, False), ("seed", np.uint64, 0), ("stream", np.uint64, 0),
            ("repetition", np.float32, 1.0), ("frequency", np.float32, 0.0),
            ("presence", np.float32, 0.0), ("has_penalties", bool, False),
            ("wants_logprobs", bool, False), ("min_tokens", np.int32, 0),
            ("has_stop_ids", bool, False), ("has_fixed_adjust", bool, False),
            ("has_bad_words", bool, False), ("keeps_outputs", bool, False),
            ("num_out", np.int32, 0)):
            arr = np.full(n, empty, dtype)
            self._cols[name] = (arr, empty)
            setattr(self, "_" + name, arr)
        # Output token ids, kept only for rows with penalties or bad words.
        self._out = np.zeros((n, 64), np.int32)
        # Per-row Python objects, only for rows that need a per-vocab row.
        self._objs: dict[str, list] = {name: [None] * n for name in (
            "prompt", "bias", "allowed", "bad_words", "stop_ids")}
        self._next_stream = 0
        # The row-only part of the last step's metadata, reused while the batch's
        # rows and their requests stay the same (every decode step in between).
        self._version = 0  # bumped by every add, remove and move
        self._static: tuple | None = None
        # Moves arrays to the device (the runner sets it, with its sharding): the
        # row-only arrays are then sent once per batch layout, not every step
        # (`variant_metadata` must then be given the same function).
        self.device_put: Callable[[Any], Any] | None = None

    # ---- row lifecycle -------------------------------------------------------

    def add(self, row: int, params: SamplingParams, prompt_token_ids: Sequence[int],
            output_token_ids: Sequence[int] = ()) -> None:
        """Puts a request in `row` (a resumed request passes the outputs it has)."""
        self.remove(row)
        self._version += 1
        V = self.vocab_size
        self._active[row] = True
        self._greedy[row] = params.greedy
        if not params.greedy:
            self._temperature[row] = params.temperature
            self._top_k[row] = params.top_k if 0 < params.top_k < V else 0
            self._top_p[row] = params.top_p
            self._min_p[row] = params.min_p
        self._seeded[row] = params.seed is not None
        self._seed[row] = params.seed or 0
        self._stream[row] = self._next_stream
        self._next_stream += 1
        if params.needs_penalties:
            self._has_penalties[row] = True
            self._repetition[row] = params.repetition_penalty
            self._frequency[row] = params.frequency_penalty
            self._presence[row] = params.presence_penalty
            self._objs["prompt"][row] = _ids(prompt_token_ids, V)
        self._wants_logprobs[row] = params.logprobs is not None
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias.keys(), np.int64)
            self._objs["bias"][row] = (_check_ids(ids, V, "logit_bias"),
                                       np.fromiter(params.logit_bias.values(), np.float32))
        if params.allowed_token_ids:
            self._objs["allowed"][row] = _check_ids(
                np.asarray(params.allowed_token_ids, np.int64), V, "allowed_token_ids")
        self._has_fixed_adjust[row] = bool(params.logit_bias or params.allowed_token_ids)
        # A bad word whose last token is outside the model's vocabulary bans nothing.
        words = [np.asarray(w, np.int64) for w in params.bad_words_token_ids or ()
                 if w and 0 <= w[-1] < V]
        if words:
            self._objs["bad_words"][row] = words
            self._has_bad_words[row] = True
        stop_ids = params.all_stop_token_ids
        if stop_ids is None:
            stop_ids = params.stop_token_ids or []
        stop_ids = _ids(stop_ids, V)
        if params.min_tokens and stop_ids.size:
            self._min_tokens[row] = params.min_tokens
            self._has_stop_ids[row] = True
            self._objs["stop_ids"][row] = stop_ids
        self._keeps_outputs[row] = self._has_penalties[row] or self._has_bad_words[row]
        outs = np.asarray(output_token_ids, np.int32).reshape(-1)
        self._num_out[row] = outs.size
        if self._keeps_outputs[row] and outs.size:
            self._reserve(outs.size)
            self._out[row, :outs.size] = outs

    def remove(self, row: int) -> None:
        self._version += 1
        for arr, empty in self._cols.values():
            arr[row] = empty
        for objs in self._objs.values():
            objs[row] = None

    def move(self, src: int, dst: int) -> None:
        """Moves the request in `src` to `dst` (overwriting it); `src` becomes empty."""
        if src == dst:
            return
        self._version += 1
        for arr, _ in self._cols.values():
            arr[dst] = arr[src]
        for objs in self._objs.values():
            objs[dst] = objs[src]
        self._out[dst] = self._out[src]
        self.remove(src)

    def append_token(self, row: int, token_id: int) -> None:
        self.append_tokens(np.array([row]), np.array([token_id]))

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Records one sampled token for each of `rows` (distinct rows)."""
        rows = np.asarray(rows, np.int64)
        keep = self._keeps_outputs[rows]
        if keep.any():
            kr = rows[keep]
            pos = self._num_out[kr]
            self._reserve(int(pos.max()) + 1)
            self._out[kr, pos] = np.asarray(token_ids)[keep]
        self._num_out[rows] += 1

    def num_output_tokens(self, row: int) -> int:
        return int(self._num_out[row])

    def is_active(self, row: int) -> bool:
        return bool(self._active[row])

    def _reserve(self, length: int) -> None:
        cap = self._out.shape[1]
        if length > cap:
            while cap < length:
                cap *= 2
            out = np.zeros((self.max_num_reqs, cap), np.int32)
            out[:, :self._out.shape[1]] = self._out
            self._out = out

    # ---- per-step metadata ---------------------------------------------------

    def make_metadata(self, rows: np.ndarray, padded_size: int, engine_seed: int,
                      out_index: Array | None = None) -> SamplingMetadata:
        """Metadata for batch rows `rows` (batch row j = request row rows[j]), padded.

        The keys depend only on the request and its output index, never on the
        step (see sample/rng.py). `out_index` is the output index each
        row samples now, `[>= padded_size]` (rows past `n` are padding): the
        runner passes its forward's device array. By default the number of
        outputs recorded, which lags when a step is still in flight.
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        n, R = rows.size, padded_size
        if n > R:
            raise ValueError(f"{n} rows do not fit a bucket of {R}")

        static = self._static_part(rows, R, engine_seed)
        if out_index is None:
            out_index = np.zeros(R, np.int32)
            out_index[:n] = self._num_out[rows]
        return SamplingMetadata(
            *static["rows"], out_index=out_index,
            penalties=self._penalties(rows, R) if static["any_penalties"] else None,
            logit_adjust=self._logit_adjust(rows, R) if static["any_adjust"] else None,
            num_logprobs=static["num_logprobs"], all_greedy=static["all_greedy"],
            use_top_k_top_p=static["use_top_k_top_p"],
        )

    def _static_part(self, rows: np.ndarray, R: int, engine_seed: int) -> dict:
        """What the metadata of `rows` holds that does not change from step to step."""
        cached = self._static
        if (cached is not None and cached[0] == (self._version, R, engine_seed)
                and cached[1].tobytes() == rows.tobytes()):
            return cached[2]
        n = rows.size

        def pad(values: np.ndarray, empty: object, dtype: type) -> np.ndarray:
            out = np.full((R, *values.shape[1:]), empty, dtype)
            out[:n] = values
            return out

        greedy = self._greedy[rows]
        top_k, top_p = self._top_k[rows], self._top_p[rows]
        all_greedy = bool(greedy.all())
        key_base = key_base_data(self._seeded[rows], self._seed[rows], engine_seed,
                                 self._stream[rows])
        # temperature, top_k, top_p, min_p, greedy, key_base (SamplingMetadata's order)
        row_arrays = (pad(self._temperature[rows], 1.0, np.float32), pad(top_k, 0, np.int32),
                      pad(top_p, 1.0, np.float32), pad(self._min_p[rows], 0.0, np.float32),
                      pad(greedy, True, bool), pad(key_base, 0, np.uint32))
        static = dict(
            rows=self.device_put(row_arrays) if self.device_put else row_arrays,
            any_penalties=bool(self._has_penalties[rows].any()),
            any_adjust=bool((self._has_fixed_adjust[rows] | self._has_bad_words[rows]
                             | self._has_stop_ids[rows]).any()),
            num_logprobs=MAX_LOGPROBS if self._wants_logprobs[rows].any() else 0,
            all_greedy=all_greedy,
            use_top_k_top_p=not all_greedy and bool(((top_k > 0) | (top_p < 1.0)).any()))
        self._static = ((self._version, R, engine_seed), rows.copy(), static)
        return static

    def _penalties(self, rows: np.ndarray, R: int) -> Penalties | None:
        batch = np.flatnonzero(self._has_penalties[rows])
        if batch.size == 0:
            return None
        V = self.vocab_size
        rep, freq, pres = np.ones(R, np.float32), np.zeros(R, np.float32), np.zeros(R, np.float32)
        req = rows[batch]
        rep[batch], freq[batch], pres[batch] = (self._repetition[req], self._frequency[req],
                                                self._presence[req])
        counts = np.zeros((R, V), np.int32)
        lens = self._num_out[req]
        if lens.max(initial=0) > 0:
            toks = self._out[req, :lens.max()]
            valid = np.arange(toks.shape[1]) < lens[:, None]
            np.add.at(counts, (np.broadcast_to(batch[:, None], toks.shape)[valid], toks[valid]), 1)
        prompts = [self._objs["prompt"][r] for r in req]
        prompt_mask = np.zeros((R, V), bool)
        prompt_mask[np.repeat(batch, [p.size for p in prompts]), np.concatenate(prompts)] = True
        return Penalties(rep, freq, pres, counts, prompt_mask)

    def _logit_adjust(self, rows: np.ndarray, R: int) -> np.ndarray | None:
        num_out = self._num_out[rows]
        before_min = self._has_stop_ids[rows] & (num_out < self._min_tokens[rows])
        needs = self._has_fixed_adjust[rows] | self._has_bad_words[rows] | before_min
        if not needs.any():
            return None
        adjust = np.zeros((R, self.vocab_size), np.float32)
        for j in np.flatnonzero(needs):
            r = rows[j]
            if (allowed := self._objs["allowed"][r]) is not None:
                adjust[j] = -np.inf
                adjust[j, allowed] = 0.0
            if (bias := self._objs["bias"][r]) is not None:
                adjust[j, bias[0]] += bias[1]
            if before_min[j]:
                adjust[j, self._objs["stop_ids"][r]] = -np.inf
            for word in self._objs["bad_words"][r] or ():
                prefix = len(word) - 1
                if prefix == 0 or (prefix <= num_out[j] and np.array_equal(
                        self._out[r, num_out[j] - prefix:num_out[j]], word[:-1])):
                    adjust[j, word[-1]] = -np.inf
        return adjust


def _ids(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Token ids as int64, dropping any outside the model's vocabulary."""
    arr = np.asarray(ids, np.int64).reshape(-1)
    return arr[(arr >= 0) & (arr < vocab_size)]


def _check_ids(ids: np.ndarray, vocab_size: int, name: str) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name}: token ids must be in [0, {vocab_size})")
    return ids
