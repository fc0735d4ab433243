"""Per-step sampling inputs: host-side request rows and the device pytree built from them.

`SamplingRows` keeps every running request's sampling knobs in persistent
numpy rows (the model runner keeps a request in one row across steps and
condenses rows with `move`). Each step `make_metadata` gathers the scheduled
rows into a `SamplingMetadata` padded to the request bucket, vectorized over
rows; only rows that need a per-vocab row (penalties, logit bias, allowed
tokens, bad words, min_tokens) are visited one by one.

`SamplingMetadata` is a pytree. Its optional parts are `None` when no
scheduled row needs them, and its static fields are part of the pytree
structure, so every combination is one compiled variant of `sample`:

    mode           all_greedy | random | random + top-k/top-p    (3)
    penalties      None | present                                (2)
    logit_adjust   None | present                                (2)
    num_logprobs   0 | MAX_LOGPROBS                              (2)

24 variants per request bucket at most; `variant_metadata` builds a dummy of
each for compiling ahead of serving.

RNG: the key for a request's i-th output token is a pure function of
(seed, i) for a seeded request, and of (engine_seed, stream, i) otherwise,
where `stream` is a counter handed out by `add`. So a seeded request samples
the same tokens whatever its row, its batch and its padding. The host keeps
each row's key base (the part without i); the keys themselves are derived on
the device, inside the sampling program, from the base and the output index,
which the runner's forward passes on from its packed inputs: a step then
sends the sampler no host array (beside a GPU each costs ~0.1 ms of host time).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

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
    num_logprobs: int = field(default=0, metadata=dict(static=True))
    all_greedy: bool = field(default=False, metadata=dict(static=True))
    use_top_k_top_p: bool = field(default=False, metadata=dict(static=True))


# splitmix64 finalizer; domain tags keep seeded and unseeded streams apart.
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_TAG_SEEDED, _TAG_UNSEEDED, _TAG_INDEX = (np.uint64(0x9E3779B97F4A7C15),
                                          np.uint64(0xD1B54A32D192ED03),
                                          np.uint64(0x8CB92BA72F3D8DD7))


def _mix64(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _key_base(seeded: np.ndarray, seed: np.ndarray, engine_seed: int,
              stream: np.ndarray) -> np.ndarray:
    """The part of each row's keys that does not depend on the output index, `[n]` u64."""
    seed = np.asarray(seed, np.uint64).reshape(-1)
    stream = np.asarray(stream, np.uint64).reshape(-1)
    eng = np.full_like(seed, np.uint64(engine_seed % 2**64))
    return np.where(seeded, _mix64(seed ^ _TAG_SEEDED),
                    _mix64(_mix64(eng ^ _TAG_UNSEEDED) ^ stream))


def key_base_data(seeded: np.ndarray, seed: np.ndarray, engine_seed: int,
                  stream: np.ndarray) -> np.ndarray:
    """Each row's key base as `[n, 2]` u32 (high, low): `SamplingMetadata.key_base`."""
    base = _key_base(seeded, seed, engine_seed, stream)
    return np.stack([base >> np.uint64(32), base & np.uint64(0xFFFFFFFF)], -1).astype(np.uint32)


def rng_key_data(seeded: np.ndarray, seed: np.ndarray, engine_seed: int, stream: np.ndarray,
                 index: np.ndarray) -> np.ndarray:
    """Threefry key data `[n, 2]` u32 for each row's `index`-th output token."""
    index = np.asarray(index, np.int32).reshape(-1)
    return np.asarray(rng_keys(key_base_data(seeded, seed, engine_seed, stream), index))


# splitmix64 on the device, where 64-bit integers are two u32 words (high, low).
_U32 = jnp.uint32


def _words(c: np.uint64) -> tuple[np.uint32, np.uint32]:
    return np.uint32(int(c) >> 32), np.uint32(int(c) & 0xFFFFFFFF)


def _xorshift(hi: jax.Array, lo: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x ^ (x >> k), 0 < k < 32."""
    return hi ^ (hi >> k), lo ^ ((lo >> k) | (hi << (32 - k)))


def _mul(hi: jax.Array, lo: jax.Array, c: np.uint64) -> tuple[jax.Array, jax.Array]:
    """x * c mod 2**64. The low words' full 64-bit product is built from 16-bit halves."""
    ch, cl = _words(c)
    a1, a0 = lo >> 16, lo & 0xFFFF
    b1, b0 = np.uint32(int(cl) >> 16), np.uint32(int(cl) & 0xFFFF)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(_U32)
    low = p00 + (mid << 16)
    low_carry = (low < p00).astype(_U32)
    high = p11 + (mid >> 16) + (mid_carry << 16) + low_carry
    return high + lo * ch + hi * cl, low


def _mix64_words(hi: jax.Array, lo: jax.Array) -> tuple[jax.Array, jax.Array]:
    hi, lo = _mul(*_xorshift(hi, lo, 30), _M1)
    hi, lo = _mul(*_xorshift(hi, lo, 27), _M2)
    return _xorshift(hi, lo, 31)


def rng_keys(key_base: Array, out_index: Array) -> jax.Array:
    """Threefry key data `[R, 2]` u32 of each row's output token `out_index[:R]`:
    splitmix64(base ^ splitmix64(index ^ tag)), as high and low words. Traceable;
    the sampler calls it inside its program."""
    base = jnp.asarray(key_base, _U32)
    index = jnp.asarray(out_index)[:base.shape[0]].astype(_U32)
    tag_hi, tag_lo = _words(_TAG_INDEX)
    ihi, ilo = _mix64_words(jnp.full_like(index, tag_hi), index ^ tag_lo)
    hi, lo = _mix64_words(base[:, 0] ^ ihi, base[:, 1] ^ ilo)
    return jnp.stack([hi, lo], -1)


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
        step (see the module docstring). `out_index` is the output index each
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
    for (all_greedy, tktp), pen, adj, nlp in itertools.product(
            modes, (None, penalties), (None, np.zeros((R, V), np.float32)), (0, MAX_LOGPROBS)):
        yield SamplingMetadata(
            *put((np.ones(R, np.float32), np.zeros(R, np.int32), np.ones(R, np.float32),
                  np.zeros(R, np.float32), np.full(R, all_greedy), np.zeros((R, 2), np.uint32))),
            out_index=np.zeros(R, np.int32) if out_index is None else out_index,
            penalties=pen, logit_adjust=adj, num_logprobs=nlp, all_greedy=all_greedy,
            use_top_k_top_p=tktp)
