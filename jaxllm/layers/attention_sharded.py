"""An attention backend split over a mesh axis: each device attends with its own KV heads.

XLA's SPMD partitioner splits plain ops by their operands' shardings, but it
cannot split a `pallas_call`: given a sharded operand it gathers the operand and
runs the kernel on every device (or, in TPU interpret mode, never returns). So
under tensor parallelism every backend's `write_kv` and `attend` run inside
`shard_map` over the 'model' axis: `q`, `k`, `v` split on their head axis, the
KV cache on the axis the backend names (`kv_cache_spec`), the metadata
replicated. Each device then runs the backend's body on plain local arrays:
its q heads, the kv heads those q heads read, and its slice of every page. No
collective runs inside: attention never mixes heads.

The model's head layout makes this local: its fused qkv weight groups each kv
head with the q heads that read it, and with fewer kv heads than devices the
loader replicates kv heads so that every device holds one (models/llama.py).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.layers.attention_backend import AttentionBackend, AttentionMetadata

_shard_map = getattr(jax, "shard_map", None)
if _shard_map is None:  # jax < 0.7
    from jax.experimental.shard_map import shard_map as _shard_map


class ShardedAttention:
    """`backend`'s `write_kv` / `attend` under `shard_map` over `mesh`'s `axis`.

    Same interface as `AttentionBackend`; the model calls it unchanged. Used only
    where the axis has more than one device (the runner's one-device path calls
    the backend directly).
    """

    def __init__(self, backend: AttentionBackend, mesh: Mesh, axis: str = "model"):
        self.backend, self.mesh, self.axis = backend, mesh, axis
        self.name, self.interpret = backend.name, backend.interpret

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return self.backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def kv_cache_spec(self, axis: str) -> P:
        return self.backend.kv_cache_spec(axis)

    def _map(self, body, in_specs: tuple, out_specs):
        return _shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                          check_vma=False)

    def write_kv(self, kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                 md: AttentionMetadata, page_offset: int = 0) -> jax.Array:
        cache, heads = self.backend.kv_cache_spec(self.axis), P(None, self.axis, None)

        def body(kv_cache, k, v, md):
            return self.backend.write_kv(kv_cache, k, v, md, page_offset)

        return self._map(body, (cache, heads, heads, P()), cache)(kv_cache, k, v, md)

    def qkv_parts(self, rows: int, rope: Any, write: bool, kv_scale: jax.Array | None) -> int:
        return self.backend.qkv_parts(rows, rope, write, kv_scale)

    def project_qkv(self, qkv: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                    md: AttentionMetadata, page_offset: int, *, rope: Any,
                    qk_norms: jax.Array | None, layer: int, eps: float, offset: bool,
                    kv_scale: jax.Array | None = None, write: bool = True,
                    dtype: Any = None) -> tuple[jax.Array, jax.Array]:
        cache, heads = self.backend.kv_cache_spec(self.axis), P(None, self.axis, None)
        # The optional operands go in as a tuple (an empty one where absent).
        extras = tuple(a for a in (qk_norms, kv_scale) if a is not None)

        def body(qkv, positions, kv_cache, md, extras):
            it = iter(extras)
            norms = next(it) if qk_norms is not None else None
            scale = next(it) if kv_scale is not None else None
            return self.backend.project_qkv(qkv, positions, kv_cache, md, page_offset,
                                            rope=rope, qk_norms=norms, layer=layer, eps=eps,
                                            offset=offset, kv_scale=scale, write=write,
                                            dtype=dtype)

        # qkv by kv head: `[T, KV, G + 2, D]`, or split-K partials `[S, T, KV, G + 2, D]`
        split = P(*(None,) * (qkv.ndim - 3), self.axis, None, None)
        in_specs = (split, P(), cache, P(), P())
        return self._map(body, in_specs, (heads, cache))(qkv, positions, kv_cache, md, extras)

    def attend(self, q: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None = None,
               soft_cap: float | None = None, page_offset: int = 0,
               sinks: jax.Array | None = None) -> jax.Array:
        cache, heads = self.backend.kv_cache_spec(self.axis), P(None, self.axis, None)
        # The sinks split with the query heads (an empty tuple where absent).
        extras = () if sinks is None else (sinks,)

        def body(q, kv_cache, md, extras):
            return self.backend.attend(q, kv_cache, md, sm_scale=sm_scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap,
                                       page_offset=page_offset,
                                       sinks=extras[0] if extras else None)

        specs = (heads, cache, P(), tuple(P(self.axis) for _ in extras))
        return self._map(body, specs, heads)(q, kv_cache, md, extras)


def shard_attention(backend: AttentionBackend, mesh: Mesh,
                    axis: str = "model") -> AttentionBackend | ShardedAttention:
    """`backend` itself on a one-device axis, else the backend under `shard_map`."""
    if mesh.shape[axis] == 1:
        return backend
    return ShardedAttention(backend, mesh, axis)
