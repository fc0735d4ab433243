"""The sum over 'model' that ends a row-parallel product: the attention's output
projection, the dense MLP's down projection, a mixture of experts' partial outputs,
and the lookup in a vocab-parallel embedding.

XLA's SPMD partitioner ends each with an NCCL all-reduce. A decode step's carry a few
KiB, where NCCL's fixed latency is several times the transfer and sets the step's pace
under tensor parallelism (BENCHMARKS.md, Several GPUs). With the mesh's GPUs in this
process, a step whose sums fit `pallas_kernels/peer_allreduce` (one kernel launch that
writes into the other GPUs' memory) runs the product under `shard_map` and sums its
shards with that kernel; larger steps (prefill, large batches) keep XLA's all-reduce,
whose ring uses the links' bandwidth better.

One `RowReduce` serves every such product of a model (`attach`, through the model's
`attach_row_reduce`). The workspaces' address table is a variable of the model's state,
so every step program takes it as an argument: never a constant of a cached executable,
since the workspaces move from run to run.

`JAXLLM_PEER_ALLREDUCE`: "0" keeps XLA's all-reduce everywhere; "psum" takes the same
`shard_map` route with `psum` as the sum, on any platform (how the CPU tests hold the
route to the transformers oracle on fake devices).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

ENV = "JAXLLM_PEER_ALLREDUCE"
AXIS = "model"


class PeerTable(nnx.Variable):
    """The GPUs' workspace addresses `[2, ranks]` int32 (low, high words): no weight."""


class RowReduce(nnx.Module):
    """Sums a row-parallel product's shards over 'model' for the steps `takes` accepts.

    `mode` "peer": the peer kernel; "psum": `lax.psum` (the same route, for tests).
    """

    def __init__(self, mesh: Mesh, mode: str, table: jax.Array):
        if mode not in ("peer", "psum"):
            raise ValueError(f"mode {mode!r} is not 'peer' or 'psum'")
        self.mesh = mesh
        self.mode = mode
        self.ranks = mesh.shape[AXIS]
        self.table = PeerTable(table)

    def cache_key(self) -> list:
        """What the programs traced with this reduce depend on (the program cache's key)."""
        from pallas_kernels.peer_allreduce import gpu

        return [self.mode, gpu.CHUNK, gpu.MAX_WORDS]

    def takes(self, rows: int, cols: int, dtype: Any) -> bool:
        """Whether a `[rows, cols]` sum of `dtype` goes this way: what the kernel takes
        (float32 or bfloat16, at most its workspace's size), in either mode."""
        from pallas_kernels.peer_allreduce import gpu

        return gpu.supported(jax.ShapeDtypeStruct((rows, cols), dtype))

    def sum(self, partial: jax.Array, table: jax.Array) -> jax.Array:
        """`partial` summed over 'model', inside `shard_map` (`table`: this module's)."""
        if self.mode == "psum":
            return jax.lax.psum(partial, AXIS)
        from pallas_kernels.peer_allreduce import gpu

        return gpu.all_reduce(partial, table, AXIS, self.ranks)

    def product(self, fn: Callable[..., jax.Array], args: Sequence[jax.Array],
                in_specs: Sequence[P]) -> jax.Array:
        """`fn` of the shards of `args` (split as `in_specs`), summed over 'model': the
        same whole value on every device."""
        def body(table, *local):
            return self.sum(fn(*local), table)

        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(), *in_specs), out_specs=P(),
                             check_vma=False)(self.table[...], *args)


@dataclasses.dataclass(frozen=True)
class _Shard:
    """A `Linear`'s parameters as one device holds them, for its method's `apply`."""

    in_dims: int
    weight: jax.Array
    weight_scale: jax.Array | None = None
    input_scale: jax.Array | None = None
    bias: None = None  # added once, after the sum


def linear_product(layer: Any, x: jax.Array) -> jax.Array | None:
    """`layer(x)` for a row-parallel `Linear` whose `reduce` takes the step, its shards
    summed by it; None where the layer keeps XLA's all-reduce (no reduce, an adapter
    attached, a step the reduce does not take)."""
    reduce = layer.reduce
    if reduce is None or layer.lora is not None:
        return None
    w = layer.weight[...]
    out_dims = w.ndim - layer.in_dims
    if not reduce.takes(x.shape[0], int(np.prod(w.shape[:out_dims])), x.dtype):
        return None
    spec = tuple(layer.spec) + (None,) * (w.ndim - len(layer.spec))
    # The weight and whatever scales its method holds, each split as it is stored.
    parts = {"weight": P(*spec), "weight_scale": P(*spec[:out_dims]), "input_scale": P()}
    names = [n for n in parts if getattr(layer, n, None) is not None]

    def local(x, *arrays):
        shard = _Shard(layer.in_dims, **dict(zip(names, arrays, strict=True)))
        return layer.method.apply(shard, x)

    out = reduce.product(local, [x, *(getattr(layer, n)[...] for n in names)],
                         [P(None, *spec[out_dims:]), *(parts[n] for n in names)])
    return out if layer.bias is None else out + layer.bias[...]


def embedding_lookup(reduce: RowReduce | None, table: jax.Array,
                     ids: jax.Array) -> jax.Array | None:
    """The rows `ids` of a `[vocab, H]` table split over 'model' by vocabulary: each
    device takes the rows it holds and zeros elsewhere, and the reduce sums them: exact,
    as XLA's own lookup (which sums masked rows too), since each row has one nonzero
    term. None where XLA's lookup stays: no reduce, a step it does not take, or a table
    kept whole (a vocabulary 'model' does not divide, distributed/mesh.py). XLA's lookup
    ends in an all-reduce, the last collective of a decode step's forward: without it
    the forward holds none of XLA's."""
    if (reduce is None or table.shape[0] % reduce.ranks
            or not reduce.takes(ids.shape[0], table.shape[1], table.dtype)):
        return None

    def local(ids, shard):
        local_ids = ids - jax.lax.axis_index(AXIS) * shard.shape[0]
        held = (local_ids >= 0) & (local_ids < shard.shape[0])
        rows = jnp.take(shard, jnp.where(held, local_ids, 0), axis=0)
        return jnp.where(held[:, None], rows, jnp.zeros((), rows.dtype))

    return reduce.product(local, [ids, table], [P(), P(AXIS, None)])


def attach(model: nnx.Module, mesh: Mesh | None) -> RowReduce | None:
    """The reduce for `mesh` (`make`), given to every row-parallel product of `model`
    through its `attach_row_reduce`; None where XLA's all-reduce stays (no reduce for the
    mesh, or a model without that method)."""
    reduce = make(mesh) if hasattr(model, "attach_row_reduce") else None
    if reduce is not None:
        model.attach_row_reduce(reduce)
    return reduce


def mode_for(mesh: Mesh) -> str | None:
    """The sum this mesh's programs take: "peer", "psum" or None (XLA's all-reduce):
    "peer" by default where the mesh is several CUDA GPUs of this process."""
    setting = os.environ.get(ENV, "1")
    if mesh.shape.get(AXIS, 1) == 1 or setting == "0":
        return None
    if setting == "psum":
        return "psum"
    devices = list(mesh.devices.flat)
    if devices[0].platform != "gpu" or "cuda" not in devices[0].client.platform_version.lower():
        return None
    if any(d.process_index != jax.process_index() for d in devices):
        return None  # another process's buffers have no address here
    return "peer"


_WORKSPACES: dict[Any, Any] = {}  # by mesh: allocated once a process, kept for its life


def make(mesh: Mesh | None) -> RowReduce | None:
    """The `RowReduce` for `mesh` (None: XLA's all-reduce, see `mode_for`). The peer
    workspaces are allocated once a process; GPUs that cannot reach each other's memory
    keep XLA's all-reduce, with a warning."""
    mode = None if mesh is None else mode_for(mesh)
    if mode is None:
        return None
    if mode == "psum":
        table = np.zeros((2, mesh.shape[AXIS]), np.int32)
        return RowReduce(mesh, mode, jax.device_put(table, NamedSharding(mesh, P())))
    from pallas_kernels.peer_allreduce import gpu

    key = tuple(d.id for d in mesh.devices.flat)
    if key not in _WORKSPACES:
        try:
            _WORKSPACES[key] = gpu.Workspace(mesh, AXIS)
        except (OSError, RuntimeError) as e:
            logger.warning("peer all-reduce off, XLA's all-reduce instead: %s", e)
            _WORKSPACES[key] = None
    ws = _WORKSPACES[key]
    return None if ws is None else RowReduce(mesh, mode, ws.table)
