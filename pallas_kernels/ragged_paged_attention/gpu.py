"""Ragged paged attention as a Pallas GPU kernel (Triton lowering).

Same semantics as `xla.py` (the oracle); only the KV cache layout differs.

Layout. The cache is head-major inside each page:
`[num_pages, 2 * num_kv_heads, page_size, head_dim]`, K of kv head h at 2h and V
at 2h + 1. One (page, head) block is `page_size * head_dim` contiguous elements,
so a KV tile is `page_size`-row runs of whole 128..512-byte rows: every load is
coalesced whatever the number of heads (one head per shard under TP included).

Work decomposition. The wrapper cuts every request's query rows into blocks of
`block_q` tokens ("items", at most `cdiv(T, block_q) + R + 1` of them, padding
tokens included) with a few vectorised jnp ops. A program handles one
(item, kv head, kv split): its Q tile is the `block_q * G` rows (token, query
head of the group) of that kv head, so GQA shares each K/V tile across the G
query heads and a decode item still feeds the tensor cores a 16-row tile. It
walks the item's KV blocks in three runs: window-edge blocks (masked), fully
visible blocks (no mask arithmetic), causal-diagonal / `kv_len`-tail blocks
(masked). Softmax is online, in float32, in base 2.

Decodes beside prompt chunks. In a prefill-shaped call (prefill tiles of
`block_q` = 128 / G tokens), a request with a single query token would still
take a whole program with a 128-row tile and a shallow pipeline, much slower
than the decode tiles for the same rows. So a prefill-shaped call runs in two: the
one-token requests first, one item each with the decode tiles
(`BlockSizes.decode`), then everything else with the prefill tiles, writing
into the first call's output (aliased), so every row is written exactly once.

Split-KV. With `num_kv_splits = S > 1` every program only walks its 1/S of the
item's KV blocks and writes an unnormalised partial (normalised output plus
log-sum-exp, float32); a small kernel (`combine_splits`) merges them. The wrapper
turns it on for decode-shaped calls (few tokens) where (items x kv heads) alone
would not fill the GPU.

Attention sinks (optional; no operand without them) join each row's softmax
exactly once: at the end of its program's walk with one split, in
`combine_splits` (as one more split holding only the sink) with several.

Padding. Rows past `cu_q_lens[num_seqs]` are written as zeros by padding items;
requests at index >= num_seqs own no item and are never read.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# The shared cache layout and its update, re-exported: `gpu.write_kv`, `tpu.kv_cache_shape`.
from pallas_kernels.ragged_paged_attention.paged_layout import kv_cache_shape as kv_cache_shape
from pallas_kernels.ragged_paged_attention.paged_layout import write_kv as write_kv
from pallas_kernels.triton_util import compiler_params as _compiler_params
from pallas_kernels.triton_util import dot_t as _dot_t
from pallas_kernels.triton_util import load as _load
from pallas_kernels.triton_util import store as _store

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables. `block_q` is in tokens (the tile has block_q * G rows)."""

    block_q: int
    block_kv: int
    num_kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    # Stream K/V through L2 with evict-first (each tile is read once per program).
    kv_evict_first: bool = False
    # When set (prefill tiles, one split), one-token requests run in their own
    # call with these tiles (see "Decodes beside prompt chunks").
    decode: BlockSizes | None = None


def decode_block_sizes(group: int, head_dim: int, itemsize: int = 2) -> BlockSizes:
    """Tiles for one-token query items: 16 rows (the smallest tensor-core tile;
    memory-bound anyway), small KV tiles with a deep pipeline (measured best)."""
    return BlockSizes(max(1, 16 // group), 32 if head_dim <= 128 else 16, 1,
                      num_warps=4, num_stages=3 if itemsize > 2 else 4)


def default_block_sizes(num_tokens: int, num_seqs_max: int, group: int, head_dim: int,
                        page_size: int, max_pages: int, num_kv_heads: int,
                        itemsize: int = 2) -> BlockSizes:
    """Static choice from the bucket's shapes (the kernel never sees q_lens at trace time).

    Chosen by measurement on the H100 (BENCHMARKS.md, kernels). float32 tiles hold twice
    the bytes, so they get shallower pipelines / smaller tiles to fit in shared
    memory (227 KiB per block).
    """
    f32 = itemsize > 2
    # Decode-shaped: at most one token per request slot, or so few tokens that
    # prefill-sized query tiles would idle most SMs (batch-1 decode pads to 8).
    if num_tokens <= max(num_seqs_max, 16):
        dec = decode_block_sizes(group, head_dim, itemsize)
        # Split the KV walk only when (items x kv heads) would not give the 132
        # SMs ~4 programs each (small batches); splits cost a combine pass.
        splits = max(1, min(16, 528 // max(1, num_tokens * num_kv_heads)))
        max_blocks = max(1, (max_pages * page_size) // dec.block_kv)
        splits = 1 << (min(splits, max_blocks).bit_length() - 1)
        return dataclasses.replace(dec, num_kv_splits=splits)
    dec = decode_block_sizes(group, head_dim, itemsize)
    if f32:
        if head_dim <= 128:
            return BlockSizes(max(1, 64 // group), 64, 1, 4, 2, decode=dec)
        # 64 query rows of 256 floats need more shared memory than the H100
        # gives a block; 32 rows fit.
        return BlockSizes(max(1, 32 // group), 32, 1, 4, 2, decode=dec)
    if head_dim == 128:
        # 128 query rows x 64 keys, 4 warps: faster on the H100 than 128 keys and
        # 8 warps for short prompts, level for 2048-token ones.
        return BlockSizes(max(1, 128 // group), 64, 1, num_warps=4, num_stages=3, decode=dec)
    if head_dim < 128:
        return BlockSizes(max(1, 128 // group), 128, 1, num_warps=4, num_stages=3, decode=dec)
    return BlockSizes(max(1, 64 // group), 32, 1, num_warps=8, num_stages=2, decode=dec)


def work_items(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int,
               block_q: int, *, skip_decode: bool = False) -> tuple[jax.Array, jax.Array]:
    """(request, first token) per item; request -1 marks a zero-fill padding item,
    -2 an unused grid slot. Sized statically: cdiv(T, bq) + R + 1 bounds the count.
    `skip_decode`: one-token requests get no item (`decode_items` covers them).

    Depends only on the step's metadata: under one jit every layer's call computes
    the same values and XLA keeps one copy; callers may also pass it in (`items`).
    """
    num_req = cu_q_lens.shape[0] - 1
    n = jnp.reshape(num_seqs, (-1,))[0]
    ridx = jnp.arange(num_req, dtype=jnp.int32)
    q_lens = jnp.where(ridx < n, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    if skip_decode:
        q_lens = jnp.where(q_lens == 1, 0, q_lens)
    nblk = (q_lens + block_q - 1) // block_q
    cum = jnp.cumsum(nblk)
    num_real = cum[-1]
    t_real = cu_q_lens[n]
    num_pad = (num_tokens - t_real + block_q - 1) // block_q
    num_items = pl.cdiv(num_tokens, block_q) + min(num_req, num_tokens) + 1
    i = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: one fused comparison. The default scan method is a loop of tiny
    # kernels on GPU, a large part of a decode call.
    req = jnp.searchsorted(cum, i, side="right", method="compare_all").astype(jnp.int32)
    req = jnp.minimum(req, num_req - 1)
    j = i - (cum[req] - nblk[req])
    tok_real = cu_q_lens[req] + j * block_q
    tok_pad = t_real + (i - num_real) * block_q
    is_real = i < num_real
    is_pad = (~is_real) & (i < num_real + num_pad)
    item_req = jnp.where(is_real, req, jnp.where(is_pad, -1, -2)).astype(jnp.int32)
    item_tok = jnp.where(is_real, tok_real, jnp.where(is_pad, tok_pad, 0)).astype(jnp.int32)
    # Reversed: a request's last query blocks (the most KV) start first, which
    # evens out the tail of a prefill-heavy grid.
    return item_req[::-1], item_tok[::-1]


def decode_items(cu_q_lens: jax.Array, num_seqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One item per request slot: (request, its token) where the request has exactly
    one query token, else -2 (an unused grid slot)."""
    num_req = cu_q_lens.shape[0] - 1
    n = jnp.reshape(num_seqs, (-1,))[0]
    ridx = jnp.arange(num_req, dtype=jnp.int32)
    one = (ridx < n) & (cu_q_lens[1:] - cu_q_lens[:-1] == 1)
    return (jnp.where(one, ridx, -2).astype(jnp.int32),
            jnp.where(one, cu_q_lens[:-1], 0).astype(jnp.int32))


def _kernel(item_req_ref, item_tok_ref, cu_ref, kvlen_ref, pidx_ref, off_ref, q_ref, kv_ref,
            *out_refs, aliased: bool, block_q: int, block_kv: int, group: int,
            num_q_heads: int, kv_heads: int,
            page_size: int, pages_per_seq: int, num_tokens: int, num_splits: int,
            kv_evict_first: bool, sm_scale: float, sliding_window: int | None,
            soft_cap: float | None, has_sinks: bool):
    # With sinks (one split only; split partials leave them to the combine): `[Hq]` float32.
    sink_ref = out_refs[0] if has_sinks else None
    if has_sinks:
        out_refs = out_refs[1:]
    if aliased:  # the decode call's output, as an input: the same buffer as out_refs[1]
        out_refs = out_refs[1:]
    o_ref = out_refs[0]
    lse_ref = out_refs[1] if num_splits > 1 else None
    item, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = block_q * group
    head_dim = q_ref.shape[-1]
    r = item_req_ref[item]
    t0 = item_tok_ref[item]

    row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_tok = t0 + row // group
    # Flat row of (token, query head) in q/out viewed as [T * Hq, D].
    row_flat = row_tok * num_q_heads + h * group + row % group
    d_iota = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
    out_base = split * (num_tokens * num_q_heads) if num_splits > 1 else 0

    # Gathers/scatters index every dim with an array (interpret mode has no
    # discharge rule for array + slice indexers).
    row_2d = jnp.broadcast_to((out_base + row_flat)[:, None], (rows, head_dim))

    def write(o, lse, valid):
        mask2 = jnp.broadcast_to(valid[:, None], (rows, head_dim))
        _store(o_ref, (row_2d, d_iota), o.astype(o_ref.dtype), mask=mask2)
        if lse_ref is not None:
            _store(lse_ref, (out_base + row_flat,), lse, mask=valid)

    @pl.when(r == -1)
    def _zero_fill():
        valid = row_tok < jnp.minimum(t0 + block_q, num_tokens)
        write(jnp.zeros((rows, head_dim), jnp.float32),
              jnp.full((rows,), -jnp.inf, jnp.float32), valid)

    @pl.when(r >= 0)
    def _attend():
        rr = jnp.maximum(r, 0)
        page_offset = off_ref[0]
        q_beg = cu_ref[rr]
        q_end = cu_ref[rr + 1]
        kv_len = kvlen_ref[rr]
        t1 = jnp.minimum(t0 + block_q, q_end)
        p_first = kv_len - (q_end - q_beg) + (t0 - q_beg)
        p_last = p_first + (t1 - t0) - 1
        row_valid = row_tok < t1
        row_pos = p_first + row // group

        q_mask = jnp.broadcast_to(row_valid[:, None], (rows, head_dim))
        q_rows = jnp.broadcast_to(row_flat[:, None], (rows, head_dim))
        q = _load(q_ref, (q_rows, d_iota), mask=q_mask, other=0.0)

        key_lo = 0 if sliding_window is None else jnp.maximum(p_first - sliding_window + 1, 0)
        blk_lo = key_lo // block_kv
        blk_hi = (p_last + block_kv) // block_kv  # cdiv(p_last + 1, block_kv)
        # Blocks needing no mask: all keys <= p_first (so < kv_len) and, with a
        # window, all keys > p_last - W.
        if sliding_window is None:
            full_lo = blk_lo
        else:
            full_lo = (jnp.maximum(p_last - sliding_window + 1, 0) + block_kv - 1) // block_kv
        full_hi = (p_first + 1) // block_kv
        a = jnp.clip(full_lo, blk_lo, blk_hi)
        b = jnp.clip(full_hi, a, blk_hi)
        if num_splits > 1:
            per = (blk_hi - blk_lo + num_splits - 1) // num_splits
            s_lo = jnp.minimum(blk_lo + split * per, blk_hi)
            s_hi = jnp.minimum(s_lo + per, blk_hi)
        else:
            s_lo, s_hi = blk_lo, blk_hi

        kv_iota = lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        kd_iota = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 1)
        is_f32 = q_ref.dtype == jnp.float32
        precision = lax.Precision.HIGHEST if is_f32 else None
        scale = sm_scale if soft_cap is not None else sm_scale * LOG2E
        evict = "evict_first" if kv_evict_first else None

        def block(bi, carry, masked: bool):
            acc, m_i, l_i = carry
            kpos = bi * block_kv + kv_iota
            col = jnp.minimum(kpos // page_size, pages_per_seq - 1)
            in_len = kpos < kv_len
            if masked:
                page = _load(pidx_ref, (rr * pages_per_seq + col,), mask=in_len, other=0)
            else:
                page = _load(pidx_ref, (rr * pages_per_seq + col,))
            krow = ((page + page_offset) * (2 * kv_heads) + 2 * h) * page_size + kpos % page_size
            krow = jnp.broadcast_to(krow[:, None], (block_kv, head_dim))
            if masked:
                ld_mask = jnp.broadcast_to(in_len[:, None], (block_kv, head_dim))
                k = _load(kv_ref, (krow, kd_iota), mask=ld_mask, other=0.0, eviction_policy=evict)
                v = _load(kv_ref, (krow + page_size, kd_iota), mask=ld_mask, other=0.0,
                          eviction_policy=evict)
            else:
                k = _load(kv_ref, (krow, kd_iota), eviction_policy=evict)
                v = _load(kv_ref, (krow + page_size, kd_iota), eviction_policy=evict)
            if k.dtype != q.dtype:  # an fp8 cache: its scales are applied outside the kernel
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            s = _dot_t(q, k) * scale
            if soft_cap is not None:
                s = (soft_cap * LOG2E) * jnp.tanh(s / soft_cap)
            if masked:
                mask = (kpos[None, :] <= row_pos[:, None]) & in_len[None, :]
                if sliding_window is not None:
                    mask &= kpos[None, :] > row_pos[:, None] - sliding_window
                s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - m_new[:, None])
            l_new = alpha * l_i + jnp.sum(p, axis=1)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            return acc * alpha[:, None] + pv, m_new, l_new

        carry = (jnp.zeros((rows, head_dim), jnp.float32),
                 jnp.full((rows,), MASK_VALUE, jnp.float32),
                 jnp.zeros((rows,), jnp.float32))
        masked_body = functools.partial(block, masked=True)
        plain_body = functools.partial(block, masked=False)
        # Window edge, fully visible run, causal diagonal / kv_len tail.
        carry = lax.fori_loop(jnp.maximum(blk_lo, s_lo), jnp.minimum(a, s_hi), masked_body, carry)
        carry = lax.fori_loop(jnp.maximum(a, s_lo), jnp.minimum(b, s_hi), plain_body, carry)
        carry = lax.fori_loop(jnp.maximum(b, s_lo), jnp.minimum(blk_hi, s_hi), masked_body,
                              carry)
        acc, m_i, l_i = carry
        num = 1.0
        if sink_ref is not None:
            # The sink, in the base-2 units of m, joins the softmax as one more logit
            # without a value: it adds to the denominator only.
            sink = _load(sink_ref, (h * group + row % group,)) * LOG2E
            m_all = jnp.maximum(m_i, sink)
            num = jnp.exp2(m_i - m_all)
            l_i = l_i * num + jnp.exp2(sink - m_all)
        has = l_i > 0.0
        inv = jnp.where(has, num / jnp.where(has, l_i, 1.0), 0.0)
        lse = jnp.where(has, m_i + jnp.log2(jnp.where(has, l_i, 1.0)), -jnp.inf)
        write(acc * inv[:, None], lse, row_valid)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def padded_kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int,
                          head_dim: int) -> tuple[int, int, int, int]:
    """The engine's GPU cache: the shared layout with head_dim rounded up to a power of
    two (Triton tiles are powers of two; Phi-3's 96 becomes 128), the extra columns
    zeros (`paged_layout.write_kv_padded`)."""
    return kv_cache_shape(num_pages, page_size, num_kv_heads, pow2_at_least(head_dim))


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sinks: jax.Array | None = None,
    **kw,
) -> jax.Array:
    """Ragged paged attention; `kv_cache` is `[P, 2 * Hkv, page_size, D']` (see module doc)
    with D' a power of two at least q's head_dim D (`padded_kv_cache_shape`; its columns
    past D zeros). The rest as `_attention`, which this calls with the query heads of
    each kv head padded to a power of two (Qwen2.5-7B's 7, Qwen2.5-14B's 5) and q's
    columns to D' (zeros: the scores are unchanged), then drops the padding from the
    output: the Triton tiles need powers of two."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, width = kv_cache.shape[1] // 2, kv_cache.shape[-1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    if head_dim > width or width & (width - 1):
        raise ValueError(f"the cache's head_dim {width} must be a power of two of at least "
                         f"q's {head_dim} (padded_kv_cache_shape)")
    group = num_q_heads // num_kv_heads
    padded = pow2_at_least(group)
    if padded == group and width == head_dim:
        return _attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                          sm_scale=sm_scale, sinks=sinks, **kw)
    q = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim),
                ((0, 0), (0, 0), (0, padded - group), (0, width - head_dim)))
    if sinks is not None:
        sinks = jnp.pad(sinks.reshape(num_kv_heads, group), ((0, 0), (0, padded - group)))
        sinks = sinks.reshape(num_kv_heads * padded)
    out = _attention(q.reshape(num_tokens, num_kv_heads * padded, width), kv_cache, kv_lens,
                     page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, sinks=sinks, **kw)
    out = out.reshape(num_tokens, num_kv_heads, padded, width)[:, :, :group, :head_dim]
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _attention(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    items: tuple[jax.Array, jax.Array] | None = None,
    interpret: bool = False,
    page_offset: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention for a power-of-two group and head_dim; `kv_cache` is
    `[P, 2 * Hkv, page_size, D]` (see module doc; `page_offset` as in xla.py, but an
    input of the kernel: it may be traced; `sinks` `[num_q_heads]` as in xla.py, an
    operand only where given).
    `items`, if given, must be
    `work_items(cu_q_lens, num_seqs, T, bs.block_q, skip_decode=bs.decode is not None)`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, two_h, page_size, _ = kv_cache.shape
    num_kv_heads = two_h // 2
    group = num_q_heads // num_kv_heads
    num_req, pages_per_seq = page_indices.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    for name, val in (("group", group), ("page_size", page_size), ("head_dim", head_dim)):
        if val & (val - 1):
            raise ValueError(f"{name}={val} must be a power of two for the Triton lowering")
    bs = block_sizes or default_block_sizes(num_tokens, num_req, group, head_dim, page_size,
                                            pages_per_seq, num_kv_heads,
                                            jnp.dtype(kv_cache.dtype).itemsize)
    for b in (bs, bs.decode):
        if b is not None and ((b.block_q * group) < 16 or b.block_kv < 16):
            raise ValueError(f"tile too small for tensor cores: {b}")
    if bs.decode is not None and (bs.num_kv_splits > 1 or bs.decode.num_kv_splits > 1):
        raise ValueError(f"a separate decode call needs one KV split in both calls: {bs}")
    if items is None:
        items = work_items(cu_q_lens, num_seqs, num_tokens, bs.block_q,
                           skip_decode=bs.decode is not None)
    static = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  interpret=interpret, page_offset=page_offset)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)

    into = None
    if bs.decode is not None:  # the one-token requests' rows; the main call fills the rest
        into = _call(bs.decode, decode_items(cu_q_lens, num_seqs), q, kv_cache, kv_lens,
                     page_indices, cu_q_lens, None, sinks=sinks, **static)[0]
    if bs.num_kv_splits == 1:
        outs = _call(bs, items, q, kv_cache, kv_lens, page_indices, cu_q_lens, into,
                     sinks=sinks, **static)
        return outs[0].reshape(num_tokens, num_q_heads, head_dim)
    # Split partials carry no sink: counted once per row, in the combine.
    outs = _call(bs, items, q, kv_cache, kv_lens, page_indices, cu_q_lens, into, sinks=None,
                 **static)
    rows = num_tokens * num_q_heads
    splits = bs.num_kv_splits
    return combine_splits(outs[0].reshape(splits, rows * head_dim),
                          outs[1].reshape(splits, rows), q.dtype, interpret=interpret,
                          sinks=sinks).reshape(num_tokens, num_q_heads, head_dim)


def attend_decodes_into(
    out: jax.Array,
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
    page_offset: int = 0,
) -> jax.Array:
    """`out` `[T, Hq, D]` with the rows of every one-token request replaced by their
    attention (decode tiles, one item per request); all other rows are kept. The
    update is in place (`out` is aliased to the result): a prefill body that skips
    the one-token requests and this call together write each row once."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // (kv_cache.shape[1] // 2)
    dec = decode_block_sizes(group, head_dim, jnp.dtype(kv_cache.dtype).itemsize)
    res = _call(dec, decode_items(cu_q_lens, num_seqs), q, kv_cache, kv_lens, page_indices,
                cu_q_lens, out.reshape(num_tokens * num_q_heads, head_dim),
                sm_scale=sm_scale, sliding_window=None, soft_cap=None, interpret=interpret,
                page_offset=page_offset)
    return res[0].reshape(out.shape)


def _call(b: BlockSizes, items: tuple[jax.Array, jax.Array], q, kv_cache, kv_lens,
          page_indices, cu_q_lens, into: jax.Array | None, *, sm_scale, sliding_window,
          soft_cap, interpret, page_offset, sinks=None):
    """One pallas_call of the kernel over `items`; with `into` (`[T * Hq, D]`) its
    rows are updated in place (aliased) and rows of no item keep their values.
    `sinks` (float32 `[Hq]`) only with one KV split: they complete each row's softmax."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, two_h, page_size, _ = kv_cache.shape
    num_kv_heads = two_h // 2
    pages_per_seq = page_indices.shape[1]
    rows = num_tokens * num_q_heads
    # The page offset is an input, not a constant of the kernel, so every layer's
    # call is the same kernel (compiled once per shape, not once per layer).
    args = (cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
            page_indices.astype(jnp.int32).reshape(-1),
            jnp.asarray(page_offset, jnp.int32).reshape(1), q.reshape(rows, head_dim),
            kv_cache.reshape(num_pages * two_h * page_size, head_dim))
    splits = b.num_kv_splits
    if sinks is not None:
        assert splits == 1, "split partials leave the sinks to the combine"
        args = (*args, sinks)
    kernel = functools.partial(
        _kernel, aliased=into is not None, kv_heads=num_kv_heads, block_q=b.block_q,
        block_kv=b.block_kv, group=num_q_heads // num_kv_heads, num_q_heads=num_q_heads,
        page_size=page_size, pages_per_seq=pages_per_seq, num_tokens=num_tokens,
        num_splits=splits, kv_evict_first=b.kv_evict_first, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=soft_cap, has_sinks=sinks is not None)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, head_dim), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits * rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits * rows,), jnp.float32)]
    extra = () if into is None else (into,)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(items[0].shape[0], num_kv_heads, splits),
        input_output_aliases={} if into is None else {2 + len(args): 0},
        compiler_params=_compiler_params(b.num_warps, b.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*items, *args, *extra)


def _combine_kernel(o_ref, lse_ref, *refs, head_dim: int, num_q_heads: int | None):
    """One query row: its `[S, D]` partials and `[S]` log-sum-exps merged as `_combine`;
    with `num_q_heads`, refs are (sinks `[Hq]`, out) and the row's head's sink joins."""
    sink_ref, out_ref = refs if num_q_heads is not None else (None, *refs)
    r = pl.program_id(0)
    splits = lse_ref.shape[0]
    span = pl.next_power_of_2(splits)  # Triton tiles: splits past S read as empty
    s_col = lax.broadcasted_iota(jnp.int32, (span,), 0)
    lse = _load(lse_ref, (s_col, jnp.full((span,), r, jnp.int32)), mask=s_col < splits,
                other=-jnp.inf)
    s_2d = lax.broadcasted_iota(jnp.int32, (span, head_dim), 0)
    d_2d = lax.broadcasted_iota(jnp.int32, (span, head_dim), 1)
    o = _load(o_ref, (s_2d, r * head_dim + d_2d), mask=s_2d < splits, other=0.0)
    mx = jnp.max(lse)
    if sink_ref is not None:  # one more split, with no value, whose log-sum-exp is the sink
        sink = sink_ref[lax.rem(r, num_q_heads)] * LOG2E
        mx = jnp.maximum(mx, sink)
    mx = jnp.where(jnp.abs(mx) < jnp.inf, mx, 0.0)  # no split saw a key: all weights 0
    w = jnp.exp2(lse - mx)
    tot = jnp.sum(w)
    if sink_ref is not None:
        tot = tot + jnp.exp2(sink - mx)
    out = jnp.sum(w[:, None] * o, axis=0)
    out = jnp.where(tot > 0, out / jnp.where(tot > 0, tot, 1.0), 0.0)
    d = lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
    _store(out_ref, (r * head_dim + d,), out.astype(out_ref.dtype))


def combine_splits(o: jax.Array, lse: jax.Array, dtype: jnp.dtype, *,
                   interpret: bool = False, sinks: jax.Array | None = None) -> jax.Array:
    """Split-KV partials merged, `[rows, D]` in `dtype`: `o` `[S, rows * D]` (normalised
    per split) and `lse` `[S, rows]` (base 2), float32. One kernel, a program per query
    row, where `_combine` and the cast took XLA two fusions (each a launch and a tail
    that cost more than the few bytes moved at a decode step). `sinks` (float32 `[Hq]`,
    rows ordered (token, query head)): each row's head's sink joins its softmax here,
    once, as a split that saw only the sink; no operand without them."""
    splits, rows = lse.shape
    head_dim = o.shape[1] // rows
    extra = () if sinks is None else (sinks,)
    out = pl.pallas_call(
        functools.partial(_combine_kernel, head_dim=head_dim,
                          num_q_heads=None if sinks is None else sinks.shape[0]),
        out_shape=jax.ShapeDtypeStruct((rows * head_dim,), dtype),
        grid=(rows,),
        compiler_params=_compiler_params(1, 1),
        interpret=interpret, name="ragged_paged_attention_combine",
    )(o, lse, *extra)
    return out.reshape(rows, head_dim)


def _combine(o: jax.Array, lse: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Merges split-KV partials (normalised outputs + base-2 log-sum-exp), with the
    sinks of `combine_splits`: its oracle."""
    mx = jnp.max(lse, axis=0)
    sink = None
    if sinks is not None:  # natural-log sinks per head -> base 2 per row
        sink = jnp.tile(sinks.astype(jnp.float32) * LOG2E, lse.shape[1] // sinks.shape[0])
        mx = jnp.maximum(mx, sink)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp2(lse - mx[None])
    tot = jnp.sum(w, axis=0)
    if sink is not None:
        tot = tot + jnp.exp2(sink - mx)
    out = jnp.sum(w[..., None] * o, axis=0)
    return jnp.where(tot[:, None] > 0, out / jnp.where(tot > 0, tot, 1.0)[:, None], 0.0)

