"""The model runner's per-request sampling state, kept in persistent rows.

`SamplingRows` keeps every running request's sampling knobs in numpy rows
that `InputBatch` keeps aligned with its own (a request stays in one row
across steps; `move` condenses rows), its logits processors' rows
(sample/logits_processors.py) and the device tables of the requests' outputs
(sample/output_state.py). Each step `make_metadata` gathers the scheduled rows
into a `SamplingMetadata` padded to the request bucket; what it takes from the
rows (and the processors' arguments) is built when the batch's rows change and
reused while they stay, so a step builds no per-vocab host array and reads
nothing back from the device. Each row holds its RNG key base (sample/rng.py);
the keys are made on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxllm.sample.logits_processors import PROCESSORS
from jaxllm.sample.metadata import Array, History, SamplingMetadata
from jaxllm.sample.output_state import OutputState
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
            ("wants_logprobs", bool, False)):
            arr = np.full(n, empty, dtype)
            self._cols[name] = (arr, empty)
            setattr(self, "_" + name, arr)
        self.processors = [p(n, vocab_size) for p in PROCESSORS]
        self.outputs = OutputState(n, vocab_size)
        self._next_stream = 0
        # The row-only part of the last step's metadata, reused while the batch's
        # rows and their requests stay the same (every decode step in between).
        self._version = 0  # bumped by every add, remove and move
        self._static: tuple | None = None
        self._device_put: Callable[[Any], Any] | None = None

    @property
    def device_put(self) -> Callable[[Any], Any] | None:
        """Moves arrays to the device (the runner sets it, with its sharding): the
        row-only arrays are then sent once per batch layout, not every step
        (`variant_metadata` must then be given the same function)."""
        return self._device_put

    @device_put.setter
    def device_put(self, fn: Callable[[Any], Any] | None) -> None:
        self._device_put = self.outputs.device_put = fn

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
        self._wants_logprobs[row] = params.logprobs is not None
        reads_outputs = False
        for proc in self.processors:
            if proc.add(row, params, prompt_token_ids) and proc.reads_outputs:
                reads_outputs = True
        if reads_outputs:
            self.outputs.track(row, prompt_token_ids, output_token_ids)

    def remove(self, row: int) -> None:
        self._version += 1
        for arr, empty in self._cols.values():
            arr[row] = empty
        for proc in self.processors:
            proc.remove(row)
        self.outputs.untrack(row)

    def move(self, src: int, dst: int) -> None:
        """Moves the request in `src` to `dst` (overwriting it); `src` becomes empty."""
        if src == dst:
            return
        self._version += 1
        for arr, _ in self._cols.values():
            arr[dst] = arr[src]
        for proc in self.processors:
            proc.move(src, dst)
        self.outputs.move(src, dst)
        self.remove(src)

    def is_active(self, row: int) -> bool:
        return bool(self._active[row])

    def record(self, rows: np.ndarray, sampled: np.ndarray, token_ids: jax.Array,
               padded_size: int) -> None:
        """After the sampler: the output tables take `token_ids[j]` (device, `[>= R]`)
        as the next output of batch row `rows[j]` where `sampled[j]`. Nothing to do
        (no dispatch) unless a scheduled request reads its outputs."""
        if not self.outputs.tracked.any():  # the usual step: no host work past this
            return
        tracked = self.outputs.tracked[rows] & sampled
        if not tracked.any():
            return
        upd = np.full(padded_size, self.max_num_reqs, np.int32)
        upd[:rows.size] = np.where(tracked, rows, self.max_num_reqs)
        self.outputs.record(upd, token_ids)

    # ---- per-step metadata ---------------------------------------------------

    def make_metadata(self, rows: np.ndarray, padded_size: int, engine_seed: int,
                      out_index: Array) -> SamplingMetadata:
        """Metadata for batch rows `rows` (batch row j = request row rows[j]), padded.

        The keys depend only on the request and its output index, never on the
        step (see sample/rng.py). `out_index` `[>= padded_size]` is the output
        index each row samples now (rows past `n` are padding): the runner passes
        its forward's device array, which counts a token still in flight.
        """
        rows = np.asarray(rows, np.int64).reshape(-1)
        n, R = rows.size, padded_size
        if n > R:
            raise ValueError(f"{n} rows do not fit a bucket of {R}")
        static = self._static_part(rows, R, engine_seed)
        history = None
        if static["history"] is not None:
            self.outputs.flush()  # the rows' changes, before the tables are read
            history = History(static["history"][0], self.outputs.tables, static["history"][1])
        return SamplingMetadata(
            *static["rows"], out_index=out_index, fixed=static["fixed"], history=history,
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
        put = self.device_put or (lambda x: x)

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
        # A group is present when a row uses one of its processors, then with all of them.
        groups: dict[str, tuple | None] = {}
        for group in ("fixed", "history"):
            procs = [p for p in self.processors if p.group == group]
            groups[group] = (put(tuple(p.batch_args(rows, R) for p in procs))
                             if any(p.used(rows) for p in procs) else None)
        history = groups["history"]
        static = dict(
            rows=put(row_arrays),
            fixed=groups["fixed"],
            history=None if history is None else (put(pad(rows, 0, np.int32)), history),
            num_logprobs=MAX_LOGPROBS if self._wants_logprobs[rows].any() else 0,
            all_greedy=all_greedy,
            use_top_k_top_p=not all_greedy and bool(((top_k > 0) | (top_p < 1.0)).any()))
        self._static = ((self._version, R, engine_seed), rows.copy(), static)
        return static
