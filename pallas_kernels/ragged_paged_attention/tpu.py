"""Ragged paged attention as a Mosaic TPU Pallas kernel.

Same semantics as `xla.py` (the oracle); only the KV cache layout differs.

Layout. `[num_pages, 2 * num_kv_heads, page_size, head_dim]`, K of kv head h at
2h and V at 2h + 1: one page is one contiguous DMA of every head's K and V, and
inside VMEM each head's tile `[block_kv, head_dim]` is a plain (sublane, lane)
slab, so no strided loads and no relayout for any number of heads per shard.

Grid. One step per block of `block_q` query tokens of the flattened batch (the
wrapper lays queries out as `[Hkv, T * G, D]`, so a kv head's G query heads are
one `[block_q * G, D]` MXU operand and GQA reads every K/V tile once). A step
walks the requests that own tokens of its block (the wrapper finds them), and
for each request the KV blocks its tokens can see (causal, sliding window):
`pages_per_block` pages per block, fetched from HBM by async DMA into one of
two VMEM slots while the previous block is being computed (double buffering,
across request boundaries too). Metadata (kv_lens, page_indices, cu_q_lens,
num_seqs and the per-block request ranges) arrives by scalar prefetch in SMEM.
Online softmax in float32; rows of other requests are masked out (p = 0), so
they pass through untouched. Attention sinks, where given, join each row's
softmax once, after its last KV block (one more operand, absent without them).

Lane padding. The engine's cache (`padded_kv_cache_shape`) pads head_dim up to a
multiple of 128, the TPU's lane width. With a smaller minor dim (head_dim 32 or
64) the TPU stores the cache in a compact layout of its own choosing (pages
minor), so XLA converts the whole cache to this row-major layout and back around
the KV write and the kernel on every step; a 128-lane minor dim is the layout the
TPU keeps anyway. `write_kv` stores K/V zero-padded, and the kernel pads q with
zeros to the cache's minor dim, so the extra lanes add nothing to q.k and produce
zero output columns, which it drops. A cache of exactly head_dim also works.

Pages past a request's `kv_len` are not fetched; their slot keeps finite stale
data (the slots are zeroed at the start of every step), which the mask hides.
Every step is self-contained, so the grid axis is "parallel" (megacore).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import paged_layout

# The shared cache layout, re-exported: `tpu.kv_cache_shape`.
from pallas_kernels.ragged_paged_attention.paged_layout import kv_cache_shape as kv_cache_shape

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The "leave it in HBM" memory space moved from pltpu.ANY to pl.ANY.
_ANY = getattr(pl, "ANY", None) or pltpu.ANY
LANES = 128


def lane_padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a multiple of the TPU's 128 lanes."""
    return -(-head_dim // LANES) * LANES


def padded_kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int,
                          head_dim: int) -> tuple[int, int, int, int]:
    """The engine's TPU cache: the shared layout with head_dim lane-padded (module doc)."""
    return kv_cache_shape(num_pages, page_size, num_kv_heads, lane_padded_head_dim(head_dim))


# The KV write into the lane-padded cache (its extra lanes zeros).
write_kv = paged_layout.write_kv_padded


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables: query tokens per grid step, KV pages per DMA block."""

    block_q: int
    pages_per_block: int


def default_block_sizes(num_tokens: int, num_seqs_max: int, group: int, head_dim: int,
                        page_size: int) -> BlockSizes:
    """Decode-shaped buckets (no more tokens than requests) get 16-row query tiles
    (one bf16 sublane tile: a step then spans few requests, each computed on all
    rows); prefill-shaped ones 256-row tiles. KV blocks of ~256 tokens (128 for
    head_dim 256) keep two slots of every head's K and V at a few MiB of VMEM."""
    rows = 16 if num_tokens <= num_seqs_max else 256
    block_q = max(1, rows // group)
    kv_tokens = 256 if head_dim <= 128 else 128
    return BlockSizes(block_q, max(1, kv_tokens // page_size))


def _interpret_params(interpret):
    if interpret is True:
        cls = getattr(pltpu, "InterpretParams", None) or pltpu.TPUInterpretParams
        return cls()
    return interpret


def _compiler_params():
    cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
    return cls(dimension_semantics=("parallel",))


def _kernel(kvlen_ref, pidx_ref, cu_ref, nseq_ref, lo_ref, hi_ref,  # scalar prefetch
            q_ref, kv_hbm,  # q: [Hkv, bq * G, D] VMEM block; kv_hbm: HBM
            *refs,  # [sink_ref] (with sinks), o_ref, then the scratch
            block_q: int, group: int, page_size: int, pages_per_block: int,
            pages_per_seq: int, num_req: int, sm_scale: float,
            sliding_window: int | None, soft_cap: float | None, page_offset: int,
            has_sinks: bool):
    del nseq_ref  # folded into lo/hi by the wrapper
    # sink_ref: [Hkv, bq * G, 1] float32, each row's head's sink logit (one block, every step).
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    o_ref, kv_buf, sems, m_ref, l_ref, acc_ref = refs
    num_kv_heads, rows, head_dim = q_ref.shape
    block_kv = pages_per_block * page_size
    i = pl.program_id(0)
    t_blk = i * block_q

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    kv_buf[...] = jnp.zeros(kv_buf.shape, kv_buf.dtype)
    lo, hi = lo_ref[i], hi_ref[i]

    def seq_info(r):
        r = jnp.minimum(r, num_req - 1)
        q_beg, q_end, kv_len = cu_ref[r], cu_ref[r + 1], kvlen_ref[r]
        t_lo = jnp.maximum(q_beg, t_blk)
        t_hi = jnp.minimum(q_end, t_blk + block_q)
        shift = kv_len - (q_end - q_beg) - q_beg  # absolute position = token + shift
        p_lo = t_lo + shift
        p_hi = t_hi - 1 + shift
        key_lo = 0 if sliding_window is None else jnp.maximum(p_lo - sliding_window + 1, 0)
        # Truncating division: operands are >= 0 and Mosaic has no floor-div lowering.
        kb_lo = lax.div(key_lo, block_kv)
        kb_hi = jnp.maximum(kb_lo + 1, lax.div(jnp.maximum(p_hi + block_kv, 0), block_kv))
        return dict(kv_len=kv_len, t_lo=t_lo, t_hi=t_hi, shift=shift, kb_lo=kb_lo, kb_hi=kb_hi)

    def copies(r, b, slot):
        kv_len = kvlen_ref[r]
        out = []
        for j in range(pages_per_block):
            col = b * pages_per_block + j
            page = pidx_ref[r * pages_per_seq + jnp.minimum(col, pages_per_seq - 1)] + page_offset
            desc = pltpu.make_async_copy(
                kv_hbm.at[page], kv_buf.at[slot, :, pl.ds(j * page_size, page_size), :],
                sems.at[slot])
            out.append((col * page_size < kv_len, desc))
        return out

    def start(r, b, slot):
        for need, desc in copies(r, b, slot):
            pl.when(need)(desc.start)

    def wait(r, b, slot):
        for need, desc in copies(r, b, slot):
            pl.when(need)(desc.wait)

    row = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
    row_tok = t_blk + lax.div(row, jnp.int32(group))
    f32 = q_ref.dtype == jnp.float32
    # Explicit both ways: bf16 operands take the MXU's native pass whatever
    # jax_default_matmul_precision says (Mosaic rejects a bf16 matmul asked for
    # fp32 contract precision: "Bad lhs type").
    precision = lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT

    def compute(b, slot, info):
        key = b * block_kv + col
        pos = row_tok + info["shift"]
        mask = (row_tok >= info["t_lo"]) & (row_tok < info["t_hi"])
        mask &= (key <= pos) & (key < info["kv_len"])
        if sliding_window is not None:
            mask &= key > pos - sliding_window

        def head(h, _):
            q = q_ref[h]
            k = kv_buf[slot, 2 * h]
            v = kv_buf[slot, 2 * h + 1]
            if k.dtype != q.dtype:  # an fp8 cache: its scales are applied outside the kernel
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = m_new
            return 0

        lax.fori_loop(0, num_kv_heads, head, 0)

    @pl.when(lo < hi)
    def _first():
        start(lo, seq_info(lo)["kb_lo"], 0)

    def body(state):
        r, b, slot = state
        info = seq_info(r)
        seq_done = b + 1 >= info["kb_hi"]
        nr = jnp.where(seq_done, r + 1, r)
        nb = jnp.where(seq_done, seq_info(r + 1)["kb_lo"], b + 1)

        @pl.when(nr < hi)
        def _prefetch():
            start(nr, nb, 1 - slot)

        wait(r, b, slot)
        compute(b, slot, info)
        return nr, nb, 1 - slot

    lax.while_loop(lambda s: s[0] < hi, body,
                   (lo, seq_info(lo)["kb_lo"], jnp.int32(0)))

    denom = l_ref[...]
    num = 1.0
    if sink_ref is not None:
        # The sink joins the softmax as one more logit without a value: rescaled to
        # the larger of the two maxima, it adds to the denominator only. A row that
        # saw no key (acc 0) stays exactly 0.
        m, sink = m_ref[...], sink_ref[...]
        m_all = jnp.maximum(m, sink)
        num = jnp.exp(m - m_all)
        denom = denom * num + jnp.exp(sink - m_all)
    inv = jnp.where(denom > 0.0, num / jnp.where(denom > 0.0, denom, 1.0), 0.0)
    o_ref[...] = (acc_ref[...] * inv).astype(o_ref.dtype)


def block_request_ranges(cu_q_lens: jax.Array, num_seqs: jax.Array, num_blocks: int,
                         block_q: int) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of the requests owning tokens of each query block (empty past the end)."""
    n = jnp.reshape(num_seqs, (-1,))[0]
    t_real = cu_q_lens[n]
    start = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    last = jnp.minimum(start + block_q, t_real) - 1
    ends = cu_q_lens[1:]
    # compare_all: one fused comparison instead of a loop of tiny kernels.
    lo = jnp.searchsorted(ends, start, side="right", method="compare_all").astype(jnp.int32)
    hi = jnp.searchsorted(ends, last, side="right", method="compare_all").astype(jnp.int32)
    hi = jnp.minimum(hi + 1, n)
    live = start < t_real
    return jnp.where(live, lo, 0), jnp.where(live, hi, 0)


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
    interpret=False,
    page_offset: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention; `kv_cache` is `[P, 2 * Hkv, page_size, D]`, D q's head_dim
    or lane-padded past it (see module doc; `page_offset` and `sinks` `[num_q_heads]` as
    in xla.py; without sinks the kernel has no operand for them).

    `interpret=True` runs in TPU interpret mode (any host); a
    `pltpu.InterpretParams` is passed through as is.
    """
    num_tokens, num_q_heads, q_head_dim = q.shape
    _, two_h, page_size, head_dim = kv_cache.shape
    if head_dim < q_head_dim:
        raise ValueError(f"q head_dim {q_head_dim} exceeds the cache's {head_dim}")
    if head_dim > q_head_dim:  # a lane-padded cache (module doc)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, head_dim - q_head_dim)))
    num_kv_heads = two_h // 2
    group = num_q_heads // num_kv_heads
    num_req, pages_per_seq = page_indices.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    bs = block_sizes or default_block_sizes(num_tokens, num_req, group, head_dim, page_size)
    block_q = bs.block_q
    rows = block_q * group
    num_blocks = pl.cdiv(num_tokens, block_q)
    t_pad = num_blocks * block_q

    # [T, Hq, D] -> [Hkv, T * G, D]: a kv head's query heads become one operand.
    qh = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    if t_pad != num_tokens:
        qh = jnp.pad(qh, ((0, 0), (0, t_pad - num_tokens), (0, 0), (0, 0)))
    qh = qh.reshape(num_kv_heads, t_pad * group, head_dim)
    lo, hi = block_request_ranges(cu_q_lens, num_seqs, num_blocks, block_q)

    kernel = functools.partial(
        _kernel, block_q=block_q, group=group, page_size=page_size,
        pages_per_block=bs.pages_per_block, pages_per_seq=pages_per_seq, num_req=num_req,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        page_offset=page_offset, has_sinks=sinks is not None)
    qo_spec = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda i, *_: (0, i, 0))
    block_kv = bs.pages_per_block * page_size
    in_specs = [qo_spec, pl.BlockSpec(memory_space=_ANY)]
    extra = ()
    if sinks is not None:
        # Laid out as the query tile's rows (token-major, then the group's heads), so
        # the kernel reads it as m and l; the block index never moves: fetched once.
        per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group)
        sink_rows = jnp.broadcast_to(per_head, (num_kv_heads, block_q, group))
        extra = (sink_rows.reshape(num_kv_heads, rows, 1),)
        in_specs.append(pl.BlockSpec((num_kv_heads, rows, 1), lambda i, *_: (0, 0, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_blocks,),
        in_specs=in_specs,
        out_specs=qo_spec,
        scratch_shapes=[
            pltpu.VMEM((2, two_h, block_kv, head_dim), kv_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        compiler_params=_compiler_params(),
        interpret=_interpret_params(interpret),
        name="ragged_paged_attention_tpu",
    )(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1),
      cu_q_lens.astype(jnp.int32), jnp.reshape(num_seqs, (-1,)).astype(jnp.int32), lo, hi,
      qh, kv_cache, *extra)
    out = out.reshape(num_kv_heads, t_pad, group, head_dim)[:, :num_tokens]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    return out[..., :q_head_dim]
