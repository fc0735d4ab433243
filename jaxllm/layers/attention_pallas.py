"""Pallas attention backends (TPU: Mosaic; GPU: Triton, Mosaic GPU) and their KV layout.

Both kernels read the cache head-major inside each page,
`[num_pages, 2 * num_kv_heads, page_size, head_dim]` (K of kv head h at 2h, V
at 2h + 1), so one (page, head) is a contiguous `page_size x head_dim` tile: a
single DMA on TPU, coalesced rows on GPU (`paged_layout.py`); the TPU cache
lane-pads head_dim to a multiple of 128 (`tpu.py`), the GPU cache rounds it up to a power
of two for the Triton tiles (`gpu.py`; the query heads of a kv head are padded to a power
of two there too). `write_kv` scatters
this step's K/V into that layout; with the cache donated to the jitted step XLA
updates it in place (tests/kernels/test_attention_backends.py checks the alias and
the buffer).

Tensor parallelism: `attend` and `write_kv` take one shard's plain arrays; under
a mesh they run inside `shard_map` (layers/attention_sharded.py), the cache
split on axis 1 (`kv_cache_spec`: each shard holds whole K/V pairs of its heads).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm.layers.attention_backend import (
    QKV_SPLIT_ROWS,
    AttentionBackend,
    AttentionMetadata,
    qkv_kernel_enabled,
    qkv_split_k,
)
from pallas_kernels.ragged_paged_attention import paged_layout


class _PallasBackend(AttentionBackend):
    """Shared layout and KV update of the Pallas bodies; each pads head_dim as its tiles
    need (`kv_cache_shape`), the extra columns written as zeros."""

    def kv_cache_spec(self, axis: str) -> P:
        return P(None, axis, None, None)  # [pages, 2 * kv_heads, page_size, D]

    def write_kv(self, kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                 md: AttentionMetadata, page_offset: int = 0) -> jax.Array:
        return paged_layout.write_kv_padded(kv_cache, k, v, md.slot_mapping, page_offset)


class PallasTPUBackend(_PallasBackend):
    """Mosaic TPU kernel; `interpret=True` runs it in TPU interpret mode on any host.

    Its cache pads head_dim to a multiple of 128 lanes (`tpu.padded_kv_cache_shape`):
    with a narrower minor dim the TPU keeps the cache in another layout and every
    step would convert all of it for the KV write and the kernel.
    """

    name = "pallas_tpu"

    def __init__(self, interpret: bool = False):
        super().__init__(interpret)
        if interpret:
            _interpret_callbacks_on_the_host()

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        from pallas_kernels.ragged_paged_attention import tpu

        return tpu.padded_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def attend(self, q: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None = None,
               soft_cap: float | None = None, page_offset: int = 0,
               sinks: jax.Array | None = None) -> jax.Array:
        from pallas_kernels.ragged_paged_attention import tpu

        return tpu.ragged_paged_attention(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            interpret=self.interpret, page_offset=page_offset, sinks=sinks)


class PallasGPUBackend(_PallasBackend):
    """Triton GPU kernel; `interpret=True` runs it in Pallas interpret mode on any host.

    Every layer's call goes through one jitted function per backend, with the page
    offset as a traced input: the layers then share one nested program, which jax
    lowers and XLA compiles once per step shape instead of once per layer (a cold
    start's compile time is dominated by the layers otherwise).
    """

    name = "pallas_gpu"

    def __init__(self, interpret: bool = False):
        super().__init__(interpret)
        self._attend_jit = jax.jit(self._attend,
                                   static_argnames=("sm_scale", "sliding_window", "soft_cap"))
        self._project_jit = jax.jit(self._project,
                                    static_argnames=("eps", "offset", "dtype", "rope_scale"))

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        from pallas_kernels.ragged_paged_attention import gpu

        return gpu.padded_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def _kernel():
        from pallas_kernels.ragged_paged_attention import gpu

        return gpu.ragged_paged_attention

    def _attend(self, q, kv_cache, md, page_offset, sinks, *, sm_scale, sliding_window,
                soft_cap):
        return self._kernel()(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            interpret=self.interpret, page_offset=page_offset, sinks=sinks)

    def _project(self, qkv, positions, inv_freq, kv_cache, slot_mapping, page_offset,
                 qk_norms, layer, *, eps, offset, dtype, rope_scale):
        from pallas_kernels.qkv_rope import gpu

        return gpu.project_qkv(qkv, positions, inv_freq, kv_cache, slot_mapping, page_offset,
                               qk_norms, layer, eps=eps, offset=offset, dtype=dtype,
                               rope_scale=rope_scale, interpret=self.interpret)

    def _kernel_applies(self, rope: Any, write: bool, kv_scale: jax.Array | None) -> bool:
        """Whether `project_qkv` runs as the one kernel: the K/V written, a plain cache (no
        fp8 scales), whole-head rotation, and not turned off (`qkv_kernel_enabled`)."""
        from pallas_kernels.qkv_rope import gpu

        return (kv_scale is None and write and qkv_kernel_enabled()
                and gpu.supported(rope.head_dim, rope.rotary_dim))

    def qkv_parts(self, rows: int, rope: Any, write: bool, kv_scale: jax.Array | None) -> int:
        """`qkv_split_k()` partials for a decode-shaped step the kernel takes: it adds them
        as it loads its rows, where XLA's split GEMV would add them in a kernel of its own."""
        if rows > QKV_SPLIT_ROWS or not self._kernel_applies(rope, write, kv_scale):
            return 0
        return qkv_split_k()

    def project_qkv(self, qkv: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                    md: AttentionMetadata, page_offset: int, *, rope: Any,
                    qk_norms: jax.Array | None, layer: int, eps: float, offset: bool,
                    kv_scale: jax.Array | None = None, write: bool = True,
                    dtype: Any = None) -> tuple[jax.Array, jax.Array]:
        """The base's contract in one kernel (pallas_kernels/qkv_rope) where it applies
        (`_kernel_applies`)."""
        if not self._kernel_applies(rope, write, kv_scale):
            return super().project_qkv(qkv, positions, kv_cache, md, page_offset, rope=rope,
                                       qk_norms=qk_norms, layer=layer, eps=eps,
                                       offset=offset, kv_scale=kv_scale, write=write,
                                       dtype=dtype)
        inv_freq = jnp.asarray(np.asarray(rope.inv_freq, np.float32))
        return self._project_jit(qkv, positions, inv_freq, kv_cache, md.slot_mapping,
                                 jnp.int32(page_offset), qk_norms, jnp.int32(layer), eps=eps,
                                 offset=offset, dtype=None if qkv.ndim == 4 else jnp.dtype(dtype),
                                 rope_scale=rope.scale)

    def attend(self, q: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None = None,
               soft_cap: float | None = None, page_offset: int = 0,
               sinks: jax.Array | None = None) -> jax.Array:
        # sinks: a traced operand, or None (an empty pytree: the program without them).
        return self._attend_jit(q, kv_cache, md, jnp.int32(page_offset), sinks,
                                sm_scale=sm_scale, sliding_window=sliding_window,
                                soft_cap=soft_cap)


class PallasGPUMosaicBackend(PallasGPUBackend):
    """The GPU default on Hopper ("auto"): prefill-shaped steps (bf16/f16, head_dim
    64/128, no window, soft-cap or sinks) run the Mosaic GPU kernel (`gpu_mgpu.py`: TMA page
    copies, wgmma, persistent CTAs; its one-token requests go to the Triton decode
    tiles), everything else the Triton body, because its prefill calls are faster
    than the Triton body's at the shapes it covers (BENCHMARKS.md, kernels).

    A program loaded from the persistent caches (a warm start) links each Mosaic GPU
    kernel's host code against the Mosaic GPU runtime's functions
    (`mosaic_gpu_launch_kernel`, `mosaic_gpu_init_tma_desc`), which are in the process
    only once jax's Mosaic GPU module has been imported. A warm start runs the
    programs without tracing the kernel, so nothing imported it and the load failed
    with "Failed to lookup host symbol ... anonymous_mosaic_gpu" (H100, jax 0.11.2).
    The backend imports it when it is made, before any program loads.
    """

    name = "pallas_gpu_mosaic"

    def __init__(self, interpret: bool = False):
        super().__init__(interpret)
        from pallas_kernels.ragged_paged_attention import gpu_mgpu  # noqa: F401  (see above)

    @staticmethod
    def _kernel():
        from pallas_kernels.ragged_paged_attention import gpu_mgpu

        return gpu_mgpu.ragged_paged_attention


def _interpret_callbacks_on_the_host() -> None:
    """Lets TPU interpret mode run under `shard_map` on several CPU devices.

    The interpreter simulates a kernel through `io_callback`s, and every device's
    kernel waits for the others at a barrier. jax hands each callback its
    arguments after a `device_put` to CPU device 0; a callback of device 1 then
    waits for a transfer queued on device 0, which sits in the barrier waiting for
    device 1, and the step never returns (jax 0.10.2, fake CPU devices). The
    interpreter's callbacks only read their arguments as numpy arrays, so for
    them alone (by module) the arguments are handed over as host arrays directly;
    every other `io_callback` keeps jax's path.
    """
    from jax._src import callback as jax_callback

    original = jax_callback.io_callback_impl
    if getattr(original, "_jaxllm_interpret_patch", False):
        return

    def interpreter_of(cb) -> bool:
        fn = getattr(cb, "callback_func", None)
        fn = getattr(fn, "func", fn)  # functools.partial
        return getattr(fn, "__module__", "").startswith("jax._src.pallas.mosaic.interpret")

    def io_callback_impl(*args, callback, **params):
        if not interpreter_of(callback):
            return original(*args, callback=callback, **params)
        host = jax.tree.map(np.asarray, args)
        return jax.tree.map(np.asarray, callback(*host))

    io_callback_impl._jaxllm_interpret_patch = True
    jax_callback.io_callback_impl = io_callback_impl

