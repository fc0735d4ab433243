"""The paged KV cache: how many blocks fit in the device's memory, and the one sharded
array that holds every layer's blocks.

The attention backend owns the cache's layout (`kv_cache_shape`) and how it is
sharded; this module only sizes and allocates it. Block 0 is the reserved
null block, so a cache of `num_blocks` serves `num_blocks - 1`. With KV cache
groups (jaxllm/kv_groups.py) a block id stands for one page of each layer of a
group, not of every layer: a request holds blocks in every group, but the
sliding-window groups hold few, so more tokens fit in the same memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxllm.config import CacheConfig, EngineConfig
from jaxllm.distributed.mesh import kv_cache_sharding
from jaxllm.distributed.multihost import agree_min
from jaxllm.errors import ParameterError
from jaxllm.kv_groups import KVCacheGroups, blocks_per_request
from jaxllm.models.loader import kv_cache_spec
from jaxllm.quant_config import kv_cache_dtype
from jaxllm.sample.output_state import OutputState
from jaxllm.worker.buckets import Buckets

logger = logging.getLogger(__name__)

# On a CPU backend no memory statistics bound the cache: at most this many bytes.
_CPU_DEFAULT_KV_BYTES = 1 << 30


def device_memory_total(platform: str, bytes_limit: int) -> int:
    """The device's whole memory, from its allocator's pool size.

    JAX's GPU allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of the device's
    memory (0.75 unless set; `import jaxllm` sets 0.95 where nothing else did);
    elsewhere the pool is the whole memory.
    """
    if platform != "gpu":
        return bytes_limit
    return int(bytes_limit / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))


@dataclass(frozen=True)
class PagedKVCache:
    """The cache's shape parameters on one mesh, for one attention backend."""

    attn_backend: Any
    mesh: Mesh
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: Any
    # Bytes another cache holds per block of this one (a draft model's, same block ids).
    extra_bytes_per_block: int = field(default=0, kw_only=True)
    groups: KVCacheGroups | None = field(default=None, kw_only=True)  # None: one of every layer

    @property
    def pages_per_block(self) -> int:
        """The layers' pages one block id stands for."""
        return self.num_layers if self.groups is None else self.groups.group_size

    def bytes_per_block(self) -> int:
        """One block id's pages, over the whole mesh (and the extra cache's)."""
        shape = self.attn_backend.kv_cache_shape(1, self.block_size, self.num_kv_heads,
                                                 self.head_dim)
        return (int(np.prod(shape)) * jnp.dtype(self.dtype).itemsize * self.pages_per_block
                + self.extra_bytes_per_block)

    def num_blocks(self, cache: CacheConfig, max_num_seqs: int, max_model_len: int,
                   activation_reserve: Callable[[], int],
                   memory_stats: dict[str, int] | None = None,
                   max_chunk: int | None = None) -> int:
        """Blocks to allocate, the null block included.

        `cache.num_gpu_blocks_override` is the count itself, as vLLM's (with KV cache
        groups, ids of a page per layer of a group: `override_num_blocks`);
        `cache.num_kv_blocks` fixes the memory, in blocks of every layer (with KV
        cache groups a block id covers fewer layers: more ids fit); else
        `cache.kv_cache_bytes` is the budget; else, on an accelerator,
        `hbm_utilization` of the device's memory less what is in use and
        `activation_reserve()` (the step's transient memory); on the CPU, every
        sequence at full length (sliding-window groups holding what prefill
        chunks of `max_chunk` tokens need), capped. `memory_stats` stands in for
        the device's own (`bytes_limit`, `bytes_in_use`) where it has none to
        give: a compile-only TPU device (worker/tpu_compile.py).
        """
        per_block = self.bytes_per_block()
        windows = (None,) if self.groups is None else self.groups.windows
        if cache.num_gpu_blocks_override:
            return override_num_blocks(cache.num_gpu_blocks_override, windows, self.block_size,
                                       max_model_len, max_chunk or max_model_len)
        if cache.num_kv_blocks:  # the memory of that many blocks of every layer
            return int(cache.num_kv_blocks) * self.num_layers // self.pages_per_block + 1
        budget = cache.kv_cache_bytes
        device = own_device(self.mesh)
        if budget is None and device.platform != "cpu":
            stats = memory_stats or device.memory_stats() or {}
            limit, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
            # hbm_utilization is a share of the device's whole memory, as vLLM's
            # gpu_memory_utilization; the allocator's pool may be smaller.
            if not limit and device.platform == "gpu":  # an allocator without statistics
                free, total = gpu_memory(device)
                limit, used = total, total - free
            else:
                total = device_memory_total(device.platform, limit)
            budget = min(int(total * cache.hbm_utilization), limit) - used
            budget -= activation_reserve()
            budget *= self.mesh.shape["model"]  # the cache is sharded over kv heads
        per_seq = blocks_per_request(windows, max_model_len, self.block_size,
                                     max_chunk or max_model_len)
        if budget is None:
            want = max_num_seqs * per_seq * per_block
            budget = min(want, _CPU_DEFAULT_KV_BYTES)
        # Every host of a multi-host engine allocates the same cache: the least any holds.
        num_blocks = agree_min(int(budget // per_block))
        if num_blocks < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block "
                             f"({per_block} bytes each): raise hbm_utilization or kv_cache_bytes")
        logger.info("KV cache: %d blocks of %d tokens in %d group(s) (%.2f GiB); %.1f "
                    "sequences of max_model_len %d fit at once", num_blocks - 1,
                    self.block_size, len(windows), num_blocks * per_block / 2**30,
                    (num_blocks - 1) / per_seq, max_model_len)
        return num_blocks

    def allocate(self, num_blocks: int) -> jax.Array:
        """One array for every layer's pages: block b of the layer at slot s of its group
        is page s * num_blocks + b (without groups the slot is the layer)."""
        shape = self.attn_backend.kv_cache_shape(self.pages_per_block * num_blocks,
                                                 self.block_size,
                                                 self.num_kv_heads, self.head_dim)
        sharding = kv_cache_sharding(self.mesh, self.attn_backend)
        dtype = self.dtype
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def cuda_runtime() -> Any:
    """CUDA's runtime library (the one JAX's CUDA plugin has loaded already), or None."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def gpu_memory(device: Any) -> tuple[int, int]:
    """(free, total) bytes of a GPU by CUDA's runtime, as vLLM's `mem_get_info`: what
    sizes the cache under XLA's VMM allocator, which gives no memory statistics. Free
    memory is what nothing on the device holds, this process's weights included."""
    lib = cuda_runtime()
    if lib is None:
        raise RuntimeError("the GPU allocator gives no memory statistics and CUDA's runtime "
                           "library was not found: set kv_cache_bytes or "
                           "num_gpu_blocks_override")
    current, free, total = ctypes.c_int(), ctypes.c_size_t(), ctypes.c_size_t()
    lib.cudaGetDevice(ctypes.byref(current))
    try:
        rc = lib.cudaSetDevice(device.local_hardware_id) or lib.cudaMemGetInfo(
            ctypes.byref(free), ctypes.byref(total))
    finally:
        lib.cudaSetDevice(current.value)
    if rc:
        raise RuntimeError(f"cudaMemGetInfo failed (CUDA error {rc}): set kv_cache_bytes or "
                           "num_gpu_blocks_override")
    return free.value, total.value


def own_device(mesh: Mesh) -> Any:
    """The first of `mesh`'s devices this process drives: in a job of several processes
    the others' devices are not addressable here and have no memory statistics to give."""
    here = jax.process_index()
    return next((d for d in mesh.devices.flat if getattr(d, "process_index", 0) == here),
                mesh.devices.flat[0])


def override_num_blocks(override: int, windows: tuple[int | None, ...], block_size: int,
                        max_model_len: int, max_chunk: int) -> int:
    """vLLM's `num_gpu_blocks_override`: the pool's block count, the null block
    included. Like vLLM's hybrid allocator it counts block ids shared by every KV
    cache group, each id one page in each layer of a group; it must hold one request
    of `max_model_len` (every group's blocks, computing `max_chunk` tokens a step)."""
    need = blocks_per_request(windows, max_model_len, block_size, max_chunk) + 1
    if override < need:
        raise ParameterError(
            "num_gpu_blocks_override",
            f"{override} blocks cannot hold one request of max_model_len={max_model_len}: "
            f"it needs {need} ({need - 1} over {len(windows)} KV cache group(s) of "
            f"{block_size}-token blocks, and the null block); raise it or lower max_model_len")
    logger.info("KV cache: num_gpu_blocks_override=%d blocks of %d tokens in %d group(s)",
                override, block_size, len(windows))
    return override


def model_kv_groups(model: Any) -> KVCacheGroups:
    """The KV cache groups of a loaded model (a decoder's per-layer sliding windows);
    one group of every layer for a model without them."""
    arch = getattr(model, "arch", None)
    windows = getattr(arch, "sliding_windows", None)
    return KVCacheGroups.from_windows(windows or (None,))


def activation_reserve(hf_config: Any, max_tokens: int, max_reqs: int, vocab_size: int,
                       dtype: Any, prompt_logprobs_rows: int, max_num_seqs: int = 0, *,
                       bucket_tokens: int) -> int:
    """A generous bound on a step's transient memory (activations + logits) for the
    largest token bucket `max_tokens` and request bucket `max_reqs`, plus what is
    allocated after the cache and held: the sampler's output tables of `max_num_seqs`
    rows, and every token bucket's forward outputs (programs.step_functions): `[tokens,
    hidden]` states for the `bucket_tokens` of all buckets together."""
    hidden = hf_config.hidden_size
    inter = int(getattr(hf_config, "intermediate_size", 4 * hidden))
    itemsize = jnp.dtype(dtype).itemsize
    act = max_tokens * (4 * hidden + 3 * inter) * itemsize
    # Sampling's logits (max_reqs rows) or the prompt-logprobs chunk's, float32, with copies.
    logits = max(max_reqs, min(max_tokens, prompt_logprobs_rows)) * vocab_size * 4 * 6
    tables = OutputState.device_bytes(max_num_seqs, vocab_size)
    held = bucket_tokens * hidden * itemsize
    return int(2 * act + logits + tables + held + (256 << 20))


def engine_kv_cache(config: EngineConfig, mesh: Mesh, attn_backend: Any, buckets: Buckets,
                    vocab_size: int, dtype: Any, groups: KVCacheGroups,
                    extra_bytes_per_block: int,
                    prompt_logprobs_rows: int) -> tuple[PagedKVCache, int]:
    """The engine's cache parameters and its block count (`PagedKVCache.num_blocks`),
    with a step's transient memory reserved for the largest buckets (k + 1 logits rows
    a request when speculating)."""
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    spec = config.speculative_config
    k1 = spec.num_speculative_tokens + 1 if spec else 1
    layers, heads, head_dim = kv_cache_spec(mc.hf_config, mesh.shape["model"])
    kv = PagedKVCache(attn_backend, mesh, layers, heads, head_dim, cc.block_size,
                      jnp.dtype(kv_cache_dtype(mc)), extra_bytes_per_block=extra_bytes_per_block,
                      groups=groups)
    return kv, kv.num_blocks(
        cc, sc.max_num_seqs, mc.max_model_len,
        lambda: activation_reserve(mc.hf_config, buckets.token_buckets[-1],
                                   buckets.request_buckets[-1] * k1, vocab_size, dtype,
                                   prompt_logprobs_rows, sc.max_num_seqs,
                                   bucket_tokens=sum(buckets.token_buckets)),
        max_chunk=sc.max_num_batched_tokens)
