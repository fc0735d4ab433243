"""The device mesh and the rules that turn declared weight shardings into placements.

One process owns every local device through one `Mesh` with axes
`('data', 'model')`. Weights declare their `PartitionSpec` next to their
definition (`nnx.Param(..., out_sharding=P(...))`, see models/llama.py); this
module turns those declarations into `NamedSharding`s for a given mesh. A
dimension whose size the mesh axis does not divide is replicated instead of
sharded (always correct, just not split), so odd vocab sizes still load.

Weights are never sharded over 'data': data-parallel replicas hold full copies
of the tensor-parallel shards. The KV cache is sharded over kv heads on 'model'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError

AXES = ("data", "model")


def validate_tensor_parallel(hf_config: Any, tensor_parallel_size: int) -> None:
    """Heads must split evenly: each 'model' shard holds whole q heads and whole kv heads."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n % tensor_parallel_size:
            raise ParameterError(
                "tensor_parallel_size",
                f"{name}={n} is not divisible by tensor_parallel_size={tensor_parallel_size}; "
                f"use a tensor_parallel_size that divides {n}")


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None, *,
              hf_config: Any = None) -> Mesh:
    """A `(data, model)` mesh over the first `dp * tp` devices (all local devices by default).

    With `hf_config`, also checks that the model's heads divide over `tensor_parallel_size`.
    """
    if tensor_parallel_size < 1:
        raise ParameterError("tensor_parallel_size",
                             f"must be at least 1, got {tensor_parallel_size}")
    if data_parallel_size < 1:
        raise ParameterError("data_parallel_size", f"must be at least 1, got {data_parallel_size}")
    if hf_config is not None:
        validate_tensor_parallel(hf_config, tensor_parallel_size)
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if len(devices) < need:
        platform = devices[0].platform if devices else "none"
        raise ParameterError(
            "tensor_parallel_size",
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
            f"{tensor_parallel_size} needs {need} devices, but only {len(devices)} "
            f"{platform} device(s) are visible")
    grid = np.asarray(devices[:need], dtype=object).reshape(data_parallel_size,
                                                            tensor_parallel_size)
    # Auto axes: XLA propagates shardings from the weights through the step.
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """`spec` with every axis dropped whose mesh size does not divide its dimension."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    fitted = []
    for dim, entry in zip(shape, entries, strict=True):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        fitted.append(entry if dim % size == 0 else None)
    return P(*fitted)


def variable_sharding(var: nnx.Variable, mesh: Mesh) -> NamedSharding:
    """The placement of one declared variable (replicated when it declares none)."""
    spec = var.get_metadata().get("out_sharding") or P()
    return NamedSharding(mesh, fit_spec(P(*spec), var.get_value().shape, mesh))


def param_shardings(state: nnx.State, mesh: Mesh) -> dict:
    """NamedShardings for a module state, as a pure dict shaped like `nnx.to_pure_dict(state)`.

    Works on abstract state (from `nnx.eval_shape`) as well as on concrete arrays;
    use it for `out_shardings` / `in_shardings` of jitted functions.
    """
    shardings = jax.tree.map(lambda v: variable_sharding(v, mesh), state,
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(shardings)


def kv_cache_sharding(mesh: Mesh, attn_backend: Any) -> NamedSharding:
    """Sharding of one layer's KV cache: its head axis over 'model', all else replicated.

    The backend owns the layout, so the head axis is found by asking it for a
    probe shape whose head count is unique among the dimensions.
    """
    probe = dict(num_blocks=3, block_size=5, num_kv_heads=7, head_dim=11)
    shape = attn_backend.kv_cache_shape(**probe)
    head_axes = [i for i, d in enumerate(shape) if d in (7, 14)]
    if len(head_axes) != 1:
        raise ValueError(f"cannot find the kv-head axis of {attn_backend.name}'s KV cache "
                         f"layout {shape}")
    spec = [None] * len(shape)
    spec[head_axes[0]] = "model"
    return NamedSharding(mesh, P(*spec))
