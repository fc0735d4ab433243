"""Ragged paged attention for prefill-shaped calls as a Pallas Mosaic GPU (Hopper) kernel.

Same semantics and cache layout as `gpu.py` (`[num_pages, 2 * num_kv_heads,
page_size, head_dim]`, K of kv head h at 2h, V at 2h + 1); `xla.py` is the
oracle. `ragged_paged_attention` here takes the same arguments as
`gpu.ragged_paged_attention` and calls it for everything the fast path below
does not cover.

Fast path (all must hold; decided statically from shapes and options, see
`supported()`):

* a Hopper GPU (compute capability 9.x: wgmma, TMA) as the default backend, or
  `interpret=True` (Mosaic GPU interpret mode on the CPU, for tests);
* q and kv_cache both bfloat16 or both float16 (float32 goes to `gpu.py`);
* head_dim 64 or 128;
* page_size a multiple of 8 dividing block_kv (64 or 128): 8, 16, 32, 64, 128;
* G = num_q_heads / num_kv_heads a power of two <= 16;
* no sliding window, no soft-cap, no attention sinks;
* num_tokens a multiple of 8 (the tiled TMA view of q / out);
* prefill-shaped: num_tokens > max(num_req, 16) (below that `gpu.py` uses its
  decode tiles and split-KV, and so do we).

Work decomposition (the idea of `gpu.py`, with aligned windows): every
request's query rows, and the padding rows after the last real one, are cut
into windows of BQ = 128 / G tokens whose starts are multiples of 8
(`work_items`); an item computes its whole window but stores only the rows it
owns. A CTA handles one (item, kv head): its 128 query rows are the G query
heads of the kv head times BQ tokens, head-major (row = g * BQ + token), so
every K/V tile feeds all G heads (GQA packing). Items are ordered longest
first; with `persistent` one CTA per SM walks a strided list of them, up to
the used items' count: the list is sized for the worst case (at 16384 tokens
and 512 request slots two thirds of it is empty), and walking the empty slots
cost a visible part of each call.

CTA structure (FA3-style, three warpgroups):

* a producer warpgroup reads the item's page ids from the block table (global
  memory, loaded before it waits for the stage) and issues one TMA copy per
  page for K and for V of each `block_kv`-key step into 128B-swizzled shared
  memory, `num_stages` steps deep, with one "full" barrier per stage for K and
  for V and one "free" barrier per stage that both consumers arrive on; pages
  past kv_len re-read the last valid page (masked), so stale block-table
  entries are never dereferenced;
* two consumer warpgroups, 64 query rows each (their Q rows come in by TMA,
  one copy per (query head, token run)), compute S = Q K^T with wgmma, the
  online softmax in float32 in base 2, and O += P V with wgmma (P from
  registers). With `schedule_barrier` the two consumers hand the tensor cores
  back and forth (ping-pong), so one's softmax overlaps the other's matmuls.
* KV steps whose keys are all visible to every owned row run with no mask
  arithmetic; only the causal-diagonal steps mask.
* Output: through shared memory and TMA stores. An item that owns its whole
  window is stored per (query head, token run) from the swizzled Q/O buffer;
  any other (a request's first / last window, padding) goes through an
  unswizzled staging buffer with a ladder of power-of-two row stores, so no row
  of another request is ever written. Rows past `cu_q_lens[num_seqs]` are
  written as zeros; requests >= num_seqs own no item and are never read.

Decodes beside prompt chunks (as in `gpu.py`): a one-token request owns no
item here. As a window of 128 / G tokens it would stream its whole context
for one row; `gpu.attend_decodes_into` writes those rows afterwards with the
decode tiles, in place, so every row of the output is still written once.

On the kernel-prefill workload it runs at about cuDNN's dense attention of the
same shape and near twice `gpu.py`'s speed (BENCHMARKS.md, kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu_util import is_hopper as _is_hopper
from pallas_kernels.mosaic_gpu_util import num_sms as _num_sms
from pallas_kernels.mosaic_gpu_util import plgpu, wait_last_releases
from pallas_kernels.ragged_paged_attention import gpu

LOG2E = math.log2(math.e)
ROWS_PER_WG = 64  # one wgmma M tile per consumer warpgroup
NUM_CONSUMERS = 2
CTA_ROWS = ROWS_PER_WG * NUM_CONSUMERS
MASK = -1e30  # finite: no inf arithmetic in the softmax


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables of the Mosaic GPU body (the Q tile is fixed at 128 rows)."""

    block_kv: int = 128
    num_stages: int = 2
    schedule_barrier: bool = True
    # One CTA per SM looping over work items (the next item's K/V stream in while
    # the current one finishes) instead of one CTA per item: faster on the H100 at
    # every prefill shape of the throughput workload, level with decodes beside
    # a few prompts.
    persistent: bool = True
    # Mosaic GPU lowering semantics: "lane" (explicit register layouts; what this
    # body is written for; jax 0.10's default) or "warpgroup" (layout inference;
    # jax 0.11's default; no faster here), or None for jax's default.
    semantics: str | None = "lane"


def default_block_sizes(head_dim: int, page_size: int) -> BlockSizes:
    # Shared memory: Q/O 2 x 64 x D, O staging 2 x 64 x D, K/V 2 x stages x bkv x D
    # (bf16): D=128, bkv=128, 2 stages = 192 KiB of the 227 KiB.
    if head_dim <= 64:
        return BlockSizes(block_kv=128, num_stages=3)
    return BlockSizes(block_kv=max(128, page_size), num_stages=2)


def supported(q: jax.Array, kv_cache: jax.Array, page_indices: jax.Array, *,
              sliding_window=None, soft_cap=None, sinks=None, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> bool:
    """Whether the Mosaic GPU body covers this call (see the module docstring)."""
    if plgpu is None:
        return False
    num_tokens, num_q_heads, head_dim = q.shape
    _, two_h, page_size, _ = kv_cache.shape
    num_kv_heads = two_h // 2
    num_req = page_indices.shape[0]
    # Sinks (GPT-OSS) go to gpu.py too: this body's softmax epilogue has no sink term.
    if sliding_window is not None or soft_cap is not None or sinks is not None:
        return False
    if q.dtype != kv_cache.dtype or jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                               jnp.dtype(jnp.float16)):
        return False
    if head_dim not in (64, 128) or num_q_heads % num_kv_heads:
        return False
    group = num_q_heads // num_kv_heads
    if group & (group - 1) or group > 16:
        return False
    bs = block_sizes or default_block_sizes(head_dim, page_size)
    if bs.block_kv not in (64, 128) or page_size < 8 or bs.block_kv % page_size:
        return False
    if num_tokens <= max(num_req, 16):  # decode-shaped: gpu.py's decode tiles
        return False
    if num_tokens % 8:  # the tiled TMA view of q / out needs whole 8-row tiles
        return False
    if interpret:
        return True
    return _is_hopper()




def work_items(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int,
               block_q: int, *, skip_decode: bool = False
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Work items as (request, window start, first row, end row), and their count.

    Each request's rows [cu[r], cu[r + 1]) are covered by windows of `block_q`
    tokens whose starts are multiples of 8 (so every Q / O tile is an aligned
    TMA box of the tiled, swizzled shared-memory layout); an item computes its
    whole window but owns (stores) only rows [lo, hi) of it. Padding rows
    [cu[num_seqs], T) are one more such segment with request -1 (zero fill).
    Sized statically: every segment needs at most cdiv(len, block_q) + 1
    windows, hence cdiv(T, bq) + 2 * min(R, T) + 2 slots. The used ones come
    first, in reverse order (a request's last window, the one with the most
    keys, first); request -2 marks the unused slots after them. The count
    (shape (1,)) lets the kernel stop there rather than walk the empty slots.
    `skip_decode`: one-token requests get no item (`gpu.attend_decodes_into` covers
    them); the padding segment keeps its items whatever its length.
    """
    assert block_q % 8 == 0
    num_req = cu_q_lens.shape[0] - 1
    n = jnp.reshape(num_seqs, (-1,))[0]
    cu = cu_q_lens.astype(jnp.int32)
    ridx = jnp.arange(num_req, dtype=jnp.int32)
    t_real = cu[n]
    seg_lo = jnp.concatenate([cu[:-1], t_real[None]])
    seg_hi = jnp.concatenate([cu[1:], jnp.full((1,), num_tokens, jnp.int32)])
    live = jnp.concatenate([ridx < n, jnp.ones((1,), bool)]) & (seg_hi > seg_lo)
    if skip_decode:
        is_req = jnp.concatenate([jnp.ones((num_req,), bool), jnp.zeros((1,), bool)])
        live = live & ~(is_req & (seg_hi - seg_lo == 1))
    seg_req = jnp.concatenate([ridx, jnp.full((1,), -1, jnp.int32)])
    seg_start = (seg_lo // 8) * 8
    seg_n = jnp.where(live, (seg_hi - seg_start + block_q - 1) // block_q, 0)
    cum = jnp.cumsum(seg_n)
    num_items = pl.cdiv(num_tokens, block_q) + 2 * min(num_req, num_tokens) + 2
    i = jnp.arange(num_items, dtype=jnp.int32)
    seg = jnp.searchsorted(cum, i, side="right", method="compare_all").astype(jnp.int32)
    seg = jnp.minimum(seg, num_req)
    j = i - (cum[seg] - seg_n[seg])
    used = i < cum[-1]
    w0 = seg_start[seg] + j * block_q
    lo = jnp.maximum(w0, seg_lo[seg])
    hi = jnp.minimum(w0 + block_q, seg_hi[seg])
    req = jnp.where(used, seg_req[seg], -2).astype(jnp.int32)
    w0, lo, hi = (jnp.where(used, x, 0).astype(jnp.int32) for x in (w0, lo, hi))
    count = cum[-1].astype(jnp.int32)
    order = jnp.where(i < count, count - 1 - i, i)  # used slots reversed, then the rest
    return req[order], w0[order], lo[order], hi[order], count.reshape(1)


def _kernel(req_ref, w0_ref, lo_ref, hi_ref, count_ref, cu_ref, kvlen_ref, pidx_ref, off_ref, q_ref,
            kv_ref, out_ref, q_smem, o_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free,
            v_free, sched_bar, *, group: int, page_size: int, block_kv: int, num_stages: int,
            scale: float, schedule_barrier: bool, num_ctas: int, num_kv_heads: int,
            interpret: bool):
    bq = CTA_ROWS // group  # tokens per window
    chunk = min(bq, ROWS_PER_WG)  # rows per (query head, token run) of a warpgroup
    num_chunks = ROWS_PER_WG // chunk
    pages_per_step = block_kv // page_size
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype
    i32 = jnp.int32

    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    # Works (item, kv head), kv heads fastest; CTA c takes works c, c + num_ctas, ...
    # up to the used items' count (the list's empty slots come after them).
    num_works = count_ref[0] * num_kv_heads
    my_works = lax.div(num_works - cta + num_ctas - 1, i32(num_ctas))

    def work_info(k):
        work = cta + k * num_ctas
        item = lax.div(work, i32(num_kv_heads))
        h = lax.rem(work, i32(num_kv_heads))
        r = req_ref[item]
        w0 = w0_ref[item]
        lo = lo_ref[item]
        hi = hi_ref[item]
        rr = jnp.maximum(r, 0)
        q_end = cu_ref[rr + 1]
        kv_len = kvlen_ref[rr]
        real = r >= 0
        p_w = kv_len - q_end + w0  # absolute position of window row 0 (may be < 0)
        p_lo = p_w + (lo - w0)  # first owned row
        p_hi = p_w + (hi - w0) - 1  # last owned row
        num_steps = lax.select(real, lax.div(p_hi + block_kv, i32(block_kv)), i32(0))
        # Steps whose keys are all <= p_lo need no mask (rows before lo are not stored).
        num_full = jnp.minimum(lax.div(p_lo + 1, i32(block_kv)), num_steps)
        last_page = lax.div(jnp.maximum(kv_len - 1, 0), i32(page_size))
        return dict(h=h, r=r, rr=rr, w0=w0, lo=lo, hi=hi, p_w=p_w, num_steps=num_steps,
                    num_full=num_full, last_page=last_page)

    def chunk_coords(c):
        """(query head within group, token offset) of a warpgroup's c-th row chunk."""
        row = wg * ROWS_PER_WG + c * chunk  # row of the CTA tile, head-major
        return lax.div(row, i32(bq)), lax.rem(row, i32(bq))

    def sync_schedule():
        plgpu.barrier_arrive(sched_bar)
        plgpu.barrier_wait(sched_bar)

    def layout(x, lay):
        return x if interpret else plgpu.layout_cast(x, lay)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        qs = q_smem.at[wg]
        os_ = o_smem.at[wg]
        wgmma_layout = None if interpret else plgpu.Layout.WGMMA
        row_layout = None if interpret else plgpu.Layout.WGMMA.reduce(1)

        def qk(slot):
            k_tile = k_smem.at[slot]
            if interpret:
                s = lax.dot_general(qs[...], k_tile[...], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
                if schedule_barrier:
                    sync_schedule()
                return s

            def scope(acc_ref):
                plgpu.wgmma(acc_ref, qs, k_tile.transpose((1, 0)))
                if schedule_barrier:
                    sync_schedule()
                return acc_ref[...]

            return pl.run_scoped(scope, plgpu.ACC((ROWS_PER_WG, block_kv), jnp.float32))

        def pv(acc, p, slot):
            v_tile = v_smem.at[slot]
            if interpret:
                return acc + lax.dot_general(p, v_tile[...], (((1,), (0,)), ((), ())),
                                             preferred_element_type=jnp.float32)

            def body(acc_ref):
                plgpu.wgmma(acc_ref, p, v_tile)

            return pl.run_state(body)(plgpu.ACC.init(acc))

        def process(k, g0):
            info = work_info(k)
            h, r, w0, lo, hi, p_w = (info[x] for x in ("h", "r", "w0", "lo", "hi", "p_w"))
            num_steps, num_full = info["num_steps"], info["num_full"]
            head0 = h * group

            @pl.when(r >= 0)
            def _load_q():
                for c in range(num_chunks):
                    g, tok = chunk_coords(c)
                    row0 = pl.multiple_of(w0 + tok, 8)  # 8-aligned: whole tiles
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, chunk), head0 + g],
                                            qs.at[pl.ds(c * chunk, chunk)], q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])

            m_i = layout(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), row_layout)
            l_i = layout(jnp.full((ROWS_PER_WG,), 0.0, jnp.float32), row_layout)
            acc = layout(jnp.full((ROWS_PER_WG, head_dim), 0.0, jnp.float32), wgmma_layout)

            if schedule_barrier:
                pl.when(wg == 1)(sync_schedule)

            def step(kv_step, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(g0 + kv_step, i32(num_stages))
                plgpu.barrier_wait(k_bar.at[slot])
                s = qk(slot)
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    shape = (ROWS_PER_WG, block_kv)
                    if interpret:
                        rows = lax.broadcasted_iota(i32, shape, 0)
                        cols = lax.broadcasted_iota(i32, shape, 1)
                    else:
                        rows = plgpu.broadcasted_iota(i32, shape, 0, layout=plgpu.Layout.WGMMA)
                        cols = plgpu.broadcasted_iota(i32, shape, 1, layout=plgpu.Layout.WGMMA)
                    # Token offset of a row in the window (rows are head-major).
                    tok = lax.rem(rows + wg * ROWS_PER_WG, i32(bq))
                    s = jnp.where(cols - tok <= p_w - kv_step * block_kv, s, MASK)
                # Base-2 online softmax; m is kept in scaled units (p = one FMA + exp2).
                m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                if not interpret:
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                if schedule_barrier:
                    plgpu.barrier_arrive(sched_bar)
                plgpu.barrier_wait(v_bar.at[slot])
                if schedule_barrier:
                    plgpu.barrier_wait(sched_bar)
                acc = pv(acc, p16, slot)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = (acc, m_i, l_i)
            carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(num_full, num_steps, functools.partial(step, masked=True),
                                  carry)
            acc, m_i, l_i = carry
            if schedule_barrier:
                pl.when(wg == 0)(sync_schedule)

            inv = 1.0 / jnp.where(l_i > 0.0, l_i, 1.0)
            out = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
            whole = (lo == w0) & (hi == w0 + bq)

            @pl.when((r >= -1) & whole)
            def _store_whole():
                if interpret:  # the tiled TMA boxes need 8-aligned rows
                    qs[...] = jnp.where(lax.rem(w0, i32(8)) == 0, out, jnp.nan).astype(dtype)
                else:
                    qs[...] = out
                plgpu.commit_smem()
                for c in range(num_chunks):
                    g, tok = chunk_coords(c)
                    row0 = pl.multiple_of(w0 + tok, 8)
                    plgpu.copy_smem_to_gmem(qs.at[pl.ds(c * chunk, chunk)],
                                            out_ref.at[pl.ds(row0, chunk), head0 + g])

            @pl.when((r >= -1) & jnp.logical_not(whole))
            def _store_rows():
                os_[...] = out
                plgpu.commit_smem()
                for c in range(num_chunks):
                    g, tok = chunk_coords(c)
                    first = jnp.clip(lo - w0 - tok, 0, chunk)  # owned rows of this chunk
                    rows = jnp.clip(hi - w0 - tok, 0, chunk) - first
                    off = first
                    size = chunk
                    while size >= 1:  # power-of-two ladder: static TMA box sizes
                        def _copy(off=off, size=size, c=c, g=g, tok=tok):
                            plgpu.copy_smem_to_gmem(
                                os_.at[pl.ds(c * chunk + off, size)],
                                out_ref.at[pl.ds(w0 + tok + off, size), head0 + g])

                        pl.when((rows & size) != 0)(_copy)
                        off = off + (rows & size)
                        size //= 2

            # Q/O and the staging buffer are reused by the next work item: the
            # issuing thread waits for the stores to have read them, and the
            # warpgroup barrier in commit_smem holds the other threads until then.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.commit_smem()
            return g0 + num_steps

        lax.fori_loop(0, my_works, process, i32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        page_offset = off_ref[0]  # this layer's first page in the all-layer cache

        def process(k, g0):
            info = work_info(k)
            rr, num_steps, last_page = info["rr"], info["num_steps"], info["last_page"]
            k_head = 2 * info["h"]

            def kv_step(s, _):
                g = g0 + s
                slot = lax.rem(g, i32(num_stages))
                base = s * pages_per_step
                # Page ids first: their loads are in flight while we wait for the slot.
                pages = [pidx_ref[rr, jnp.minimum(base + j, last_page)] + page_offset
                         for j in range(pages_per_step)]

                @pl.when(g >= num_stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                for j, page in enumerate(pages):
                    plgpu.copy_gmem_to_smem(kv_ref.at[page, k_head],
                                            k_smem.at[slot, pl.ds(j * page_size, page_size)],
                                            k_bar.at[slot])

                @pl.when(g >= num_stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                for j, page in enumerate(pages):
                    plgpu.copy_gmem_to_smem(kv_ref.at[page, k_head + 1],
                                            v_smem.at[slot, pl.ds(j * page_size, page_size)],
                                            v_bar.at[slot])
                return ()

            lax.fori_loop(0, num_steps, kv_step, ())
            return g0 + num_steps

        wait_last_releases(lax.fori_loop(0, my_works, process, i32(0)), num_stages,
                           k_free, v_free)


def ragged_paged_attention(
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
    items: tuple[jax.Array, ...] | None = None,
    interpret: bool = False,
    fallback_block_sizes: gpu.BlockSizes | None = None,
    page_offset: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention; Mosaic GPU body where `supported()`, else `gpu.py`'s.

    `items` (optional) must come from this module's
    `work_items(..., 128 // G, skip_decode=True)` (used on the fast path only);
    `fallback_block_sizes` goes to `gpu.ragged_paged_attention` on the fallback;
    `page_offset` as in xla.py, but an input of the kernels: it may be traced; `sinks`
    as in xla.py (always the fallback).
    """
    if not supported(q, kv_cache, page_indices, sliding_window=sliding_window,
                     soft_cap=soft_cap, sinks=sinks, interpret=interpret,
                     block_sizes=block_sizes):
        return gpu.ragged_paged_attention(
            q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap,
            block_sizes=fallback_block_sizes, interpret=interpret, page_offset=page_offset,
            sinks=sinks)
    out = _mgpu_call(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                     sm_scale=sm_scale, block_sizes=block_sizes, items=items,
                     interpret=interpret, page_offset=page_offset)
    # The one-token requests' rows (no item above): gpu.py's decode tiles, in place.
    return gpu.attend_decodes_into(out, q, kv_cache, kv_lens, page_indices, cu_q_lens,
                                   num_seqs, sm_scale=sm_scale, interpret=interpret,
                                   page_offset=page_offset)




def _mgpu_call(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
               block_sizes, items, interpret, page_offset=0):
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, two_h, page_size, _ = kv_cache.shape
    num_kv_heads = two_h // 2
    group = num_q_heads // num_kv_heads
    bq = CTA_ROWS // group
    bs = block_sizes or default_block_sizes(head_dim, page_size)
    if items is None:
        items = work_items(cu_q_lens, num_seqs, num_tokens, bq, skip_decode=True)
    num_items = items[0].shape[0]
    num_works = num_items * num_kv_heads
    if bs.persistent:
        num_ctas = min(num_works, 2 if interpret else _num_sms())
    else:
        num_ctas = num_works

    swizzle = 128
    tile = (8, swizzle // jnp.dtype(q.dtype).itemsize)
    if interpret:
        transforms = ()
    else:
        transforms = (plgpu.TilingTransform(tile), plgpu.SwizzleTransform(swizzle))
    dt = q.dtype
    chunk = min(bq, ROWS_PER_WG)
    scratch = [
        plgpu.SMEM((NUM_CONSUMERS, ROWS_PER_WG, head_dim), dt, transforms=transforms),  # Q / O
        plgpu.SMEM((NUM_CONSUMERS, ROWS_PER_WG, head_dim), dt),  # O staging, partial windows
        plgpu.SMEM((bs.num_stages, bs.block_kv, head_dim), dt, transforms=transforms),
        plgpu.SMEM((bs.num_stages, bs.block_kv, head_dim), dt, transforms=transforms),
        plgpu.Barrier(num_arrivals=ROWS_PER_WG // chunk, num_barriers=NUM_CONSUMERS),
        plgpu.Barrier(num_arrivals=bs.block_kv // page_size, num_barriers=bs.num_stages),
        plgpu.Barrier(num_arrivals=bs.block_kv // page_size, num_barriers=bs.num_stages),
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=bs.num_stages),
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=bs.num_stages),
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
    ]
    body = functools.partial(
        _kernel, group=group, page_size=page_size, block_kv=bs.block_kv,
        num_stages=bs.num_stages, scale=float(sm_scale) * LOG2E,
        schedule_barrier=bs.schedule_barrier, num_ctas=num_ctas, num_kv_heads=num_kv_heads,
        interpret=bool(interpret))
    sem = {}
    if bs.semantics is not None:
        sem["lowering_semantics"] = getattr(plgpu.LoweringSemantics, bs.semantics.capitalize())
    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        # TMA zero-fills rows past the end of q; the interpreter reads them as
        # NaN instead (uninitialised), which also checks that they never leak.
        kw["interpret"] = interpret_params.InterpretGPUParams(
            out_of_bounds_reads="uninitialized", detect_races=interpret == "races")
    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **sem),
        **kw,
    )
    # The page offset is an input, not a constant of the kernel: every layer's call
    # is then the same kernel (one Mosaic GPU compilation per token bucket, not one
    # per layer and bucket).
    return call(*items, cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
                page_indices.astype(jnp.int32), jnp.asarray(page_offset, jnp.int32).reshape(1),
                q, kv_cache)
