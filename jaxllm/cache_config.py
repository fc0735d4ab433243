"""The KV cache's configuration: its block size, how its capacity is chosen, and the
block counts the runner's sizing sets for the scheduler.

Three ways to fix the capacity, else `hbm_utilization` of the device's memory
decides (worker/kv_cache.py). `num_kv_blocks` (jaxllm's): the memory of that
many blocks of every layer. `num_gpu_blocks_override` (vLLM's): the block pool's
size, the reserved null block included; with KV cache groups (jaxllm/kv_groups.py)
each of those block ids is one page in each layer of a group, so the memory is the
count times one page times the group's layers, as vLLM's hybrid allocator lays
it out. `kv_cache_bytes`: a byte budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.errors import ParameterError


@dataclass
class CacheConfig:
    block_size: int = 16
    hbm_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Explicit KV capacity, in blocks of every layer (KV cache groups fit more block ids).
    num_kv_blocks: int | None = None
    # vLLM's: the pool's block ids, null block included, each a page per layer of a group.
    num_gpu_blocks_override: int | None = None
    kv_cache_bytes: int | None = None
    # Set by the runner's sizing: block ids with the null block 0, and each KV cache
    # group's sliding window, None for full attention (jaxllm/kv_groups.py).
    num_blocks: int = 0
    group_windows: tuple[int | None, ...] = (None,)

    @classmethod
    def from_args(cls, args: Any, hbm_utilization: float, is_encoder: bool) -> CacheConfig:
        """The cache config of `EngineArgs` `args`, its block counts checked."""
        for name in ("num_kv_blocks", "num_gpu_blocks_override"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ParameterError(name, f"must be at least 1, got {value}")
        if args.num_kv_blocks is not None and args.num_gpu_blocks_override is not None:
            raise ParameterError("num_gpu_blocks_override",
                                 "give it or num_kv_blocks, not both (num_kv_blocks counts "
                                 "blocks of every layer, the override the pool's block ids)")
        return cls(block_size=args.block_size, hbm_utilization=hbm_utilization,
                   # An encoder keeps no KV, so there is no prefix to reuse.
                   enable_prefix_caching=args.enable_prefix_caching and not is_encoder,
                   num_kv_blocks=args.num_kv_blocks,
                   num_gpu_blocks_override=args.num_gpu_blocks_override,
                   kv_cache_bytes=args.kv_cache_bytes)
