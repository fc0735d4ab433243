"""The paged KV cache: how many blocks fit in the device's memory, and the one sharded
array that holds every layer's blocks.

The attention backend owns the cache's layout (`kv_cache_shape`) and how it is
sharded; this module only sizes and allocates it. Block 0 is the reserved
null block, so a cache of `num_blocks` serves `num_blocks - 1`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxllm.config import CacheConfig
from jaxllm.distributed.mesh import kv_cache_sharding
from jaxllm.distributed.multihost import agree_min

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
    extra_bytes_per_block: int = 0

    def bytes_per_block(self) -> int:
        """One block of every layer, over the whole mesh (and the extra cache's)."""
        shape = self.attn_backend.kv_cache_shape(1, self.block_size, self.num_kv_heads,
                                                 self.head_dim)
        return (int(np.prod(shape)) * jnp.dtype(self.dtype).itemsize * self.num_layers
                + self.extra_bytes_per_block)

    def num_blocks(self, cache: CacheConfig, max_num_seqs: int, max_model_len: int,
                   activation_reserve: Callable[[], int],
                   memory_stats: dict[str, int] | None = None) -> int:
        """Blocks to allocate, the null block included.

        `cache.num_kv_blocks` fixes the count; else `cache.kv_cache_bytes` is the
        budget; else, on an accelerator, `hbm_utilization` of the device's memory
        less what is in use and `activation_reserve()` (the step's transient
        memory); on the CPU, every sequence at full length, capped. `memory_stats`
        stands in for the device's own (`bytes_limit`, `bytes_in_use`) where it has
        none to give: a compile-only TPU device (worker/tpu_compile.py).
        """
        per_block = self.bytes_per_block()
        if cache.num_kv_blocks:
            return int(cache.num_kv_blocks) + 1  # + the reserved null block
        budget = cache.kv_cache_bytes
        device = self.mesh.devices.flat[0]
        if budget is None and device.platform != "cpu":
            stats = memory_stats or device.memory_stats() or {}
            limit, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
            # hbm_utilization is a share of the device's whole memory, as vLLM's
            # gpu_memory_utilization; the allocator's pool may be smaller.
            total = device_memory_total(device.platform, limit)
            budget = min(int(total * cache.hbm_utilization), limit) - used
            budget -= activation_reserve()
            budget *= self.mesh.shape["model"]  # the cache is sharded over kv heads
        if budget is None:
            want = max_num_seqs * (-(-max_model_len // self.block_size)) * per_block
            budget = min(want, _CPU_DEFAULT_KV_BYTES)
        # Every host of a multi-host engine allocates the same cache: the least any holds.
        num_blocks = agree_min(int(budget // per_block))
        if num_blocks < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block "
                             f"({per_block} bytes each): raise hbm_utilization or kv_cache_bytes")
        tokens = (num_blocks - 1) * self.block_size
        logger.info("KV cache: %d blocks, %d tokens (%.2f GiB); %.1f sequences of "
                    "max_model_len %d fit at once", num_blocks - 1, tokens,
                    num_blocks * per_block / 2**30, tokens / max_model_len, max_model_len)
        return num_blocks

    def allocate(self, num_blocks: int) -> jax.Array:
        """One array for every layer's pages: layer l's block b is page l * num_blocks + b."""
        shape = self.attn_backend.kv_cache_shape(self.num_layers * num_blocks, self.block_size,
                                                 self.num_kv_heads, self.head_dim)
        sharding = kv_cache_sharding(self.mesh, self.attn_backend)
        dtype = self.dtype
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def activation_reserve(hf_config: Any, max_tokens: int, max_reqs: int, vocab_size: int,
                       dtype: Any, prompt_logprobs_rows: int) -> int:
    """A generous bound on a step's transient memory (activations + logits) for the
    largest token bucket `max_tokens` and request bucket `max_reqs`."""
    hidden = hf_config.hidden_size
    inter = int(getattr(hf_config, "intermediate_size", 4 * hidden))
    act = max_tokens * (4 * hidden + 3 * inter) * jnp.dtype(dtype).itemsize
    # Sampling's logits (max_reqs rows) or the prompt-logprobs chunk's, float32, with copies.
    logits = max(max_reqs, min(max_tokens, prompt_logprobs_rows)) * vocab_size * 4 * 6
    return int(2 * act + logits + (256 << 20))
