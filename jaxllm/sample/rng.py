"""The sampler's random keys: a pure function of the request and its output index.

The key for a request's i-th output token is derived from (seed, i) for a
seeded request, and from (engine_seed, stream, i) otherwise, where `stream`
is a counter the runner's sampling rows hand out per request. So a seeded
request samples the same tokens whatever its row, its batch and its padding,
and a rejection sampler can redraw any position. The host makes each row's
key base (the part without i, `key_base_data`); the keys themselves are made
on the device inside the sampling program (`rng_keys`), from the base and the
output index the forward passes on, so a step sends the sampler no host array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array | np.ndarray

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
