"""Attention backends: one ragged paged attention semantics, one body per platform.

The model runner asks the backend for the KV cache layout (`kv_cache_shape`)
and never assumes one. `write_kv` stores this step's K/V (in place when the
cache is donated); `attend` runs ragged paged attention over a mixed batch of
prefill chunks and decodes. The layers of a model share one cache array of
`num_layers * num_blocks` pages (axis 0 of every layout): layer l's block b is
page `l * num_blocks + b`, and both calls take that `page_offset`. One array
instead of one per layer: every array a jitted step takes and returns costs
the host ~1-2 us per call. Backends: "reference" (plain jnp, the oracle, used
on the CPU), "pallas_tpu", "pallas_gpu" (Triton) and "pallas_gpu_mosaic" (Mosaic
GPU prefill body on Hopper, Triton for the rest; pallas_kernels/), chosen by
platform unless `attention_backend` names one.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError
from pallas_kernels.ragged_paged_attention import reference


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer (shapes fixed by the bucket)."""

    slot_mapping: jax.Array  # [T] int32, KV slot of each token; padding -> scratch slot
    kv_lens: jax.Array  # [R] int32, context length per request incl. new tokens
    page_indices: jax.Array  # [R, W] int32, block tables
    cu_q_lens: jax.Array  # [R + 1] int32, query start offsets
    num_seqs: jax.Array  # [1] int32, real requests

    def last_queries(self) -> AttentionMetadata:
        """The same requests with one query each, their last token, at row i for
        request i (the rows `cu_q_lens[1:] - 1` gathered): a decode-shaped call
        over the same context. Padding requests get no query."""
        r = self.kv_lens.shape[0]
        cu = jnp.minimum(jnp.arange(r + 1, dtype=jnp.int32), self.num_seqs[0])
        return dataclasses.replace(self, cu_q_lens=cu)


class AttentionBackend:
    """The reference body; subclasses replace `attend` (and the layout if they must)."""

    name = "reference"

    def __init__(self, interpret: bool = False):
        self.interpret = interpret

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def kv_cache_spec(self, axis: str) -> P:
        """How the cache splits over a mesh axis of tensor parallelism: by kv head
        (`[pages, page_size, 2 * kv_heads, D]`: K and V of a head stay together)."""
        return P(None, None, axis, None)

    def write_kv(self, kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                 md: AttentionMetadata, page_offset: int = 0) -> jax.Array:
        return reference.write_kv(kv_cache, k, v, md.slot_mapping, page_offset)

    def attend(self, q: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, *,
               sm_scale: float, sliding_window: int | None = None,
               soft_cap: float | None = None, page_offset: int = 0) -> jax.Array:
        return reference.ragged_paged_attention(
            q, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            page_offset=page_offset)


BACKENDS = ("auto", "reference", "pallas_tpu", "pallas_gpu", "pallas_gpu_mosaic")


def _mosaic_gpu_available() -> bool:
    """A Hopper GPU, and a jax with Pallas Mosaic GPU: the Mosaic GPU prefill body runs."""
    from pallas_kernels import mosaic_gpu_util

    return mosaic_gpu_util.plgpu is not None and mosaic_gpu_util.is_hopper()


@functools.cache
def get_attention_backend(name: str = "auto", interpret: bool = False) -> AttentionBackend:
    """Backend by name; "auto" picks by the default device's platform.

    "auto": "pallas_tpu" on a TPU; on a GPU "pallas_gpu_mosaic" where the Mosaic GPU
    prefill body runs (Hopper), else "pallas_gpu"; "reference" elsewhere.
    """
    if name == "auto":
        platform = jax.devices()[0].platform
        name = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(
            platform, "reference")
        if name == "pallas_gpu" and _mosaic_gpu_available():
            name = "pallas_gpu_mosaic"
    if name == "reference":
        return AttentionBackend(interpret)
    want = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "pallas_gpu_mosaic": "gpu"}.get(name)
    platform = jax.devices()[0].platform
    if want is not None and not interpret and {"cuda": "gpu", "rocm": "gpu"}.get(
            platform, platform) != want:
        raise ParameterError("attention_backend", f"{name!r} runs on a {want.upper()}; this "
                             f"process's devices are {platform!r} (use 'auto' or 'reference')")
    if name == "pallas_tpu":
        from jaxllm.layers.attention_pallas import PallasTPUBackend

        return PallasTPUBackend(interpret)
    if name == "pallas_gpu":
        from jaxllm.layers.attention_pallas import PallasGPUBackend

        return PallasGPUBackend(interpret)
    if name == "pallas_gpu_mosaic":
        from jaxllm.layers.attention_pallas import PallasGPUMosaicBackend

        return PallasGPUMosaicBackend(interpret)
    raise ParameterError("attention_backend", f"must be one of {BACKENDS}, got {name!r}")
