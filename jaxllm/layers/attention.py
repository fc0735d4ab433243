"""Attention backends: one ragged paged attention semantics, one body per platform.

The model runner asks the backend for the KV cache layout (`kv_cache_shape`)
and never assumes one. `write_kv` stores this step's K/V (in place when the
cache is donated); `attend` runs ragged paged attention over a mixed batch of
prefill chunks and decodes. The layers of a model share one cache array of
`num_layers * num_blocks` pages (axis 0 of every layout): layer l's block b is
page `l * num_blocks + b`, and both calls take that `page_offset`. With KV cache
groups (jaxllm/kv_groups.py: sliding-window layers apart from global ones) the
array has `group_size * num_blocks` pages, the layer at slot s of its group
reads page `s * num_blocks + b` through its group's block tables
(`AttentionMetadata.for_group`). One array
instead of one per layer: every array a jitted step takes and returns costs
host time on every call. Backends: "xla" (plain jnp, the oracle, used
on the CPU), "pallas_tpu", "pallas_gpu" (Triton) and "pallas_gpu_mosaic" (Mosaic
GPU prefill body on Hopper, Triton for the rest; pallas_kernels/), chosen by
platform unless `attention_backend` names one.
"""

from __future__ import annotations

import functools

import jax

from jaxllm.errors import ParameterError

# The interface and the reference body live below this module, so that the Pallas
# bodies extend them without importing the selection here.
from jaxllm.layers.attention_backend import AttentionBackend, AttentionMetadata

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]


# "reference" is the XLA body's earlier name, still accepted.
BACKENDS = ("auto", "xla", "reference", "pallas_tpu", "pallas_gpu", "pallas_gpu_mosaic")


def _mosaic_gpu_available() -> bool:
    """A Hopper GPU, and a jax with Pallas Mosaic GPU: the Mosaic GPU prefill body runs."""
    from pallas_kernels import mosaic_gpu_util

    return mosaic_gpu_util.plgpu is not None and mosaic_gpu_util.is_hopper()


@functools.cache
def get_attention_backend(name: str = "auto", interpret: bool = False) -> AttentionBackend:
    """Backend by name; "auto" picks by the default device's platform.

    "auto": "pallas_tpu" on a TPU; on a GPU "pallas_gpu_mosaic" where the Mosaic GPU
    prefill body runs (Hopper), else "pallas_gpu"; "xla" elsewhere.
    """
    if name == "auto":
        platform = jax.devices()[0].platform
        name = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(
            platform, "xla")
        if name == "pallas_gpu" and _mosaic_gpu_available():
            name = "pallas_gpu_mosaic"
    if name in ("xla", "reference"):
        return AttentionBackend(interpret)
    want = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "pallas_gpu_mosaic": "gpu"}.get(name)
    platform = jax.devices()[0].platform
    if want is not None and not interpret and {"cuda": "gpu", "rocm": "gpu"}.get(
            platform, platform) != want:
        raise ParameterError("attention_backend", f"{name!r} runs on a {want.upper()}; this "
                             f"process's devices are {platform!r} (use 'auto' or 'xla')")
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
