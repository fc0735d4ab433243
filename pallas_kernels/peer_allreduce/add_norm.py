"""The peer all-reduce with the residual add and the next RMSNorm that follow it: one
kernel for `x = residual + sum(partial)` and `rms_norm(x, weight)`.

A row-parallel projection's sum (gpu.py) is followed in every decoder layer by the
residual add and the RMSNorm of the next block's input, two small XLA kernels that
each cost about a launch at decode (BENCHMARKS.md, Several GPUs). Here the programs
exchange the partial sums as `gpu.all_reduce`'s do, one chunk each, but each waits for
its whole row to land (the row's other chunks come from the programs beside it, which
every call runs with it), so that it can add the residual and take the row's norm
statistic itself; it writes its own chunk of both outputs.

Numerics are the unfused path's: the ranks' sum in float32 in rank order, rounded
once to the model dtype; the add in float32, rounded; the norm as `jaxllm.layers.norm`
computes it (float32 statistics; Llama's `weight * bf16(x / rms)`, Gemma's
`bf16(x / rms * (1 + weight))`). Only the order of the mean's additions differs.

A program's chunk sits at the same words in every call of one row width, so these
calls use a workspace of their own for each width (`row_reduce` keeps them), never
the chunked sums' one: each program clears exactly the words its previous call sent.
The norm's weight is read in place from a table `[N, hidden]` (the model's stacked
norm weights): a slice of it passed to a custom call would be copied first.

The partial sum may come as a split-K product's float32 partials `[S, rows, hidden]`,
which each program adds in order and rounds to the model dtype before it sends its
chunk: XLA's own split-K GEMV would sum them in a kernel of its own, a launch a
projection at decode (BENCHMARKS.md, Several GPUs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.peer_allreduce import gpu
from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import store

MAX_ROWS = gpu.MAX_WORDS // gpu.CHUNK  # at most one program a chunk, as gpu.py


def row_words(hidden: int, dtype: jnp.dtype) -> int:
    """A row's 32-bit words (bfloat16 in pairs); 0 for a row the kernel refuses: a
    dtype other than bfloat16 or float32, an odd bfloat16 width, or a word count that
    is not a power of two (a Triton block's)."""
    words = gpu.words_of(jax.ShapeDtypeStruct((hidden,), dtype))
    return words if words & (words - 1) == 0 else 0


def supported(rows: int, hidden: int, dtype: jnp.dtype) -> bool:
    """Whether a `[rows, hidden]` sum of `dtype` fits: `row_words`, at most `MAX_ROWS`
    rows and `gpu.MAX_WORDS` words in all."""
    words = row_words(hidden, dtype)
    return words > 0 and 0 < rows <= MAX_ROWS and rows * words <= gpu.MAX_WORDS


def _own_words(x_ref, own: jax.Array, *, chunk: int, pairs: bool, parts: int,
               size: int) -> jax.Array:
    """This program's chunk of the partial sum as words: read as they are, or (`parts`
    > 0) the sum of float32 partials `[parts, size]`, each word's two bfloat16 halves
    read at a stride of two."""
    if not parts:
        return x_ref[pl.ds(own, chunk)]
    per = 2 if pairs else 1
    halves = []
    for half in range(per):
        total = x_ref[pl.ds(per * own + half, chunk, stride=per)]
        for p in range(1, parts):
            total = total + x_ref[pl.ds(p * size + per * own + half, chunk, stride=per)]
        halves.append(total)
    return gpu.pack(tuple(halves), pairs)


def _kernel(lo_ref, hi_ref, rank_ref, x_ref, r_ref, w_ref, o_ref, n_ref, *, ranks: int,
            words: int, chunk: int, weight_row: int, hidden: int, pairs: bool, eps: float,
            offset: bool, after_prior: bool, parts: int, size: int):
    i = pl.program_id(0)
    row = pl.multiple_of((i // (words // chunk)) * words, words)
    own = pl.multiple_of(i * chunk, chunk)
    mine = _own_words(x_ref, own, chunk=chunk, pairs=pairs, parts=parts, size=size)
    received, finish = gpu.exchange(
        lo_ref, hi_ref, rank_ref, gpu.sendable(mine, pairs), ranks=ranks,
        start=own, clear=chunk, after_prior=after_prior, poll=(row, words))

    def model_dtype(v):  # a float32 value rounded as the model dtype holds it
        if not pairs:
            return v
        return lax.bitcast_convert_type(gpu.rounded(v) & jnp.int32(-65536), jnp.float32)

    at = pl.ds(row, words)
    x = tuple(model_dtype(r + model_dtype(s)) for r, s in
              zip(gpu.unpack(r_ref[at], pairs), gpu.total(received, pairs), strict=True))
    inv = lax.rsqrt(sum(jnp.sum(v * v) for v in x) / hidden + eps)
    weight = gpu.unpack(w_ref[pl.ds(weight_row * words, words)], pairs)
    if offset:
        normed = tuple(v * inv * (1.0 + w) for v, w in zip(x, weight, strict=True))
    else:
        normed = tuple(w * model_dtype(v * inv) for v, w in zip(x, weight, strict=True))
    lane = row + lax.broadcasted_iota(jnp.int32, (words,), 0)
    held = (lane >= own) & (lane < own + chunk)  # this program's chunk of the row
    store(o_ref, at, gpu.pack(x, pairs), mask=held)
    store(n_ref, at, gpu.pack(normed, pairs), mask=held)
    finish()


def all_reduce_add_norm(x: jax.Array, residual: jax.Array, weights: jax.Array,
                        weight_row: int, eps: float, offset: bool, table: jax.Array,
                        axis_name: str, ranks: int) -> tuple[jax.Array, jax.Array]:
    """`(y, rms_norm(y, weights[weight_row], eps, offset))` for `y = residual + sum(x)`,
    the sum over `axis_name` (inside `shard_map`); `residual` `[rows, hidden]` and
    `weights` `[N, hidden]` of one dtype; `x` `[rows, hidden]` of that dtype, or float32
    partials `[S, rows, hidden]` (summed in order, then rounded to it). `table`: the
    addresses of a `gpu.Workspace` that only calls of this row width use."""
    dtype = residual.dtype
    rows, hidden = residual.shape
    parts = x.shape[0] if x.ndim == 3 else 0
    if (not supported(rows, hidden, dtype) or x.shape[-2:] != residual.shape
            or x.dtype != (jnp.float32 if parts else dtype)):
        raise ValueError(f"{x.shape} {x.dtype} is not a sum the peer add-norm takes "
                         f"onto {residual.shape} {dtype}")
    pairs = dtype == jnp.bfloat16
    words = row_words(hidden, dtype)
    chunk = min(gpu.CHUNK, words)

    def flat(v):
        v = v.astype(dtype)
        return lax.bitcast_convert_type(v.reshape(-1, 2) if pairs else v.reshape(-1), jnp.int32)

    rank = lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    out = jax.ShapeDtypeStruct((rows * words,), jnp.int32)
    summed, normed = pl.pallas_call(
        functools.partial(_kernel, ranks=ranks, words=words, chunk=chunk,
                          weight_row=weight_row, hidden=hidden, pairs=pairs, eps=float(eps),
                          offset=offset, after_prior=gpu.dependent_launch(), parts=parts,
                          size=rows * hidden),
        out_shape=(out, out), grid=(rows * words // chunk,),
        compiler_params=_compiler_params(8 if words >= 2048 else 4, 1),
        name="peer_all_reduce_add_norm",
    )(table[0], table[1], rank, x.reshape(-1) if parts else flat(x), flat(residual),
      flat(weights))

    def back(v):
        return lax.bitcast_convert_type(v, dtype).reshape(rows, hidden)

    return back(summed), back(normed)
