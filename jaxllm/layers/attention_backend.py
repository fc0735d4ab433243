"""The attention backend interface and its XLA body; the metadata every body reads.

`AttentionBackend` is the XLA (plain jnp) body, the oracle the kernels are held
to and the body the CPU runs, and the base the Pallas
bodies extend (layers/attention_pallas.py); `get_attention_backend` in
layers/attention.py picks one by name or platform.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.layers.norm import rms_norm
from jaxllm.layers.quant import FP8_MAX
from pallas_kernels.ragged_paged_attention import xla


def qkv_kernel_enabled() -> bool:
    """Whether a GPU body may run `project_qkv` as its one kernel: `JAXLLM_QKV_KERNEL=0`
    keeps the XLA ops (a benchmark's A/B knob; part of the on-disk program cache's key)."""
    return os.environ.get("JAXLLM_QKV_KERNEL", "1") != "0"


QKV_SPLIT_K = 4  # as row_reduce.SPLIT_K
QKV_SPLIT_ROWS = 32  # decode-shaped steps only: a prefill's float32 partials would be large


def qkv_split_k() -> int:
    """How many float32 split-K partials the QKV product of a decode-shaped step leaves
    for a body whose `qkv_parts` takes them: `JAXLLM_QKV_SPLIT_K` (0: none; part of the
    on-disk program cache's key)."""
    return int(os.environ.get("JAXLLM_QKV_SPLIT_K", QKV_SPLIT_K))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer (shapes fixed by the bucket)."""

    # [T] int32, KV slot of each token; padding -> scratch slot. With KV cache groups
    # (jaxllm/kv_groups.py) [G, T], one row per group, and `page_indices` [R, G * W],
    # group g's tables in columns [g * W, (g + 1) * W): `for_group` picks one.
    slot_mapping: jax.Array
    kv_lens: jax.Array  # [R] int32, context length per request incl. new tokens
    page_indices: jax.Array  # [R, W] int32, block tables
    cu_q_lens: jax.Array  # [R + 1] int32, query start offsets
    num_seqs: jax.Array  # [1] int32, real requests

    @property
    def grouped(self) -> bool:
        """Whether this metadata carries one block table per KV cache group."""
        return self.slot_mapping.ndim == 2

    def for_group(self, group: int) -> AttentionMetadata:
        """Group `group`'s slots and block tables, the form every body reads."""
        num_groups = self.slot_mapping.shape[0]
        width = self.page_indices.shape[1] // num_groups
        return dataclasses.replace(
            self, slot_mapping=self.slot_mapping[group],
            page_indices=self.page_indices[:, group * width:(group + 1) * width])

    def last_queries(self) -> AttentionMetadata:
        """The same requests with one query each, their last token, at row i for
        request i (the rows `cu_q_lens[1:] - 1` gathered): a decode-shaped call
        over the same context. Padding requests get no query."""
        r = self.kv_lens.shape[0]
        cu = jnp.minimum(jnp.arange(r + 1, dtype=jnp.int32), self.num_seqs[0])
        return dataclasses.replace(self, cu_q_lens=cu)


class AttentionBackend:
    """The XLA body; subclasses replace `attend` (and the layout if they must)."""

    name = "xla"

    def __init__(self, interpret: bool = False):
        self.interpret = interpret

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return xla.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def kv_cache_spec(self, axis: str) -> P:
        """How the cache splits over a mesh axis of tensor parallelism: by kv head
        (`[pages, page_size, 2 * kv_heads, D]`: K and V of a head stay together)."""
        return P(None, None, axis, None)

    def write_kv(self, kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                 md: AttentionMetadata, page_offset: int = 0) -> jax.Array:
        return xla.write_kv(kv_cache, k, v, md.slot_mapping, page_offset)

    def qkv_parts(self, rows: int, rope: Any, write: bool, kv_scale: jax.Array | None) -> int:
        """How many float32 split-K partials `project_qkv` takes for a step of `rows`
        tokens (0: the projection in the model dtype): none here, where XLA's own split
        GEMV and its sum cost the same."""
        return 0

    def project_qkv(self, qkv: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                    md: AttentionMetadata, page_offset: int, *, rope: Any,
                    qk_norms: jax.Array | None, layer: int, eps: float, offset: bool,
                    kv_scale: jax.Array | None = None, write: bool = True,
                    dtype: Any = None) -> tuple[jax.Array, jax.Array]:
        """A layer's work between its fused QKV projection and `attend`: the queries
        `[T, KV * G, D]` and the cache with this step's K/V written (`write`).

        `qkv [T, KV, G + 2, D]` holds per kv head its G query heads, K and V.
        `qk_norms [L, 2, D]` (Qwen3, Gemma 3), every layer's q and k norm weights:
        RMSNorm over each q and k head first with row `layer`'s (`eps`, `offset` as
        `rms_norm`'s; the whole stack is passed, since a slice of it would be one more
        copy a layer on the GPU); `rope` (layers/rotary.py) rotates both by
        `positions [T]`. `kv_scale [2]`: an fp8 cache's per-tensor K and V scales (the
        cache holds K / k_scale and V / v_scale, and q takes k_scale: q . (k_scale K) =
        (k_scale q) . K, so every attention body only upcasts the fp8 tiles it loads).
        This is the oracle; the GPU body does it in one kernel. `qkv` may be float32
        split-K partials `[S, T, KV, G + 2, D]` (`qkv_parts`): added in order, then
        rounded to `dtype`, the model dtype.
        """
        if qkv.ndim == 5:
            qkv = functools.reduce(jnp.add, qkv).astype(dtype)
        t, kv_heads, g2, d = qkv.shape
        group = g2 - 2
        q = qkv[:, :, :group].reshape(t, kv_heads * group, d)
        k, v = qkv[:, :, group], qkv[:, :, group + 1]
        if qk_norms is not None:
            q = rms_norm(q, qk_norms[layer, 0], eps, offset)
            k = rms_norm(k, qk_norms[layer, 1], eps, offset)
        q, k = rope(q, positions), rope(k, positions)
        if kv_scale is not None:
            k, v = to_fp8_range(k, kv_scale[0]), to_fp8_range(v, kv_scale[1])
            q = q * kv_scale[0].astype(q.dtype)
        if write:
            kv_cache = self.write_kv(kv_cache, k, v, md, page_offset)
        return q, kv_cache

    def attend(self, q: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None = None,
               soft_cap: float | None = None, page_offset: int = 0,
               sinks: jax.Array | None = None) -> jax.Array:
        """Each query row's attention over its request's cached keys; `sinks`: the
        query heads' learned sink logits `[num_q_heads]` float32 (GPT-OSS), or None."""
        return xla.ragged_paged_attention(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            page_offset=page_offset, sinks=sinks)


def to_fp8_range(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x / scale`, saturated to e4m3's finite range (the cache write casts it)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX)
