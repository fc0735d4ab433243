"""The device mesh and the rules that turn declared weight shardings into placements.

An engine core owns its `tp` devices through one `Mesh` with the single axis
`'model'` (data parallelism runs separate engine cores, each on its own mesh:
engine/dp_client.py). Weights declare their `PartitionSpec` next to their
definition (`nnx.Param(..., out_sharding=P(...))`, see models/llama.py); this
module turns those declarations into `NamedSharding`s for a given mesh. A
dimension whose size the mesh axis does not divide is replicated instead of
sharded (always correct, just not split), so odd vocab sizes still load.

The KV cache is sharded over kv heads on 'model' (replicated kv heads where
there are fewer than shards).
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

AXES = ("model",)


# Latent attention (models/mla.py): one kv head, the latent and rope key, whatever
# `num_key_value_heads` says.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def config_kv_heads(hf_config: Any) -> int:
    """The checkpoint's kv heads as the cache holds them (before replication)."""
    if getattr(hf_config, "model_type", None) in MLA_MODEL_TYPES:
        return 1
    heads = int(hf_config.num_attention_heads)
    return int(getattr(hf_config, "num_key_value_heads", None) or heads)


def validate_tensor_parallel(hf_config: Any, tensor_parallel_size: int) -> None:
    """Heads must split evenly: each 'model' shard holds whole q heads and whole kv heads.

    The q heads divide over the shards. The kv heads either divide too, or (fewer
    kv heads than shards) divide the shard count, and each is replicated on the
    shards whose q heads read it (vLLM's rule).
    """
    tp = tensor_parallel_size
    heads = int(hf_config.num_attention_heads)
    kv_heads = config_kv_heads(hf_config)
    if heads % tp:
        raise ParameterError(
            "tensor_parallel_size",
            f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}; "
            f"use a tensor_parallel_size that divides {heads}")
    if kv_heads % tp and tp % kv_heads:
        raise ParameterError(
            "tensor_parallel_size",
            f"num_key_value_heads={kv_heads} and tensor_parallel_size={tp}: neither divides "
            "the other, so the kv heads can neither be split nor replicated evenly")


def kv_head_replicas(hf_config: Any, tensor_parallel_size: int) -> int:
    """How many copies of each kv head the shards hold: 1 where the kv heads split
    over the shards, `tp / kv_heads` where there are fewer kv heads than shards."""
    return max(1, tensor_parallel_size // config_kv_heads(hf_config))


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None, *,
              hf_config: Any = None) -> Mesh:
    """A `('model',)` mesh over the first `tp` of `devices` (all local devices by default).

    With `hf_config`, also checks that the model's heads divide over `tensor_parallel_size`.
    """
    if tensor_parallel_size < 1:
        raise ParameterError("tensor_parallel_size",
                             f"must be at least 1, got {tensor_parallel_size}")
    if hf_config is not None:
        validate_tensor_parallel(hf_config, tensor_parallel_size)
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size
    if len(devices) < need:
        platform = devices[0].platform if devices else "none"
        raise ParameterError(
            "tensor_parallel_size",
            f"tensor_parallel_size={tensor_parallel_size} needs {need} devices, but only "
            f"{len(devices)} {platform} device(s) are visible")
    grid = np.asarray(devices[:need], dtype=object)
    # An Auto axis: XLA propagates shardings from the weights through the step.
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,))


def put_replicated(values: Any, sharding: NamedSharding) -> Any:
    """Host `values` (a pytree of arrays) whole on every device of `sharding`.

    In a job of several processes each process passes the same values (the lockstep
    replays host 0's calls) and builds its own devices' copies from them: there
    `jax.device_put` would first compare the values across the processes with a
    collective of its own, which costs a round trip and can pair with a step's
    collectives still in flight on another process.
    """
    if jax.process_count() == 1:
        return jax.device_put(values, sharding)

    def put(x: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, values)


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
    """Sharding of the KV cache: split over 'model' as the backend declares
    (`kv_cache_spec`: by kv head, whatever its layout)."""
    return NamedSharding(mesh, attn_backend.kv_cache_spec("model"))
