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

Where the sum feeds a residual add and an RMSNorm (the decoder's output and down
projections), `product_add_norm` does all three in one kernel
(`pallas_kernels/peer_allreduce/add_norm.py`), for steps whose rows it takes.

`JAXLLM_PEER_ALLREDUCE`: "0" keeps XLA's all-reduce everywhere; "psum" takes the same
`shard_map` route with `psum` as the sum, on any platform (how the CPU tests hold the
route to the transformers oracle on fake devices). `JAXLLM_PEER_ADD_NORM`: "0" keeps the
add and the norm apart from the sum. `JAXLLM_PEER_SPLIT_K`: how many float32 partials a
plain projection's product leaves for that kernel to add (`SPLIT_K` by default; "0" or
"1": one product in the model dtype, which XLA's GEMV sums in a kernel of its own).
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

from jaxllm.layers.norm import rms_norm

logger = logging.getLogger(__name__)

ENV = "JAXLLM_PEER_ALLREDUCE"
ADD_NORM_ENV = "JAXLLM_PEER_ADD_NORM"
SPLIT_K_ENV = "JAXLLM_PEER_SPLIT_K"
SPLIT_K = 4  # four slices matched XLA's own split-K GEMV at the decoder's shapes (BENCHMARKS.md)
MIN_SPLIT_WIDTH = 256  # a partial's contraction no narrower than this
AXIS = "model"


@dataclasses.dataclass(frozen=True)
class NormWeight:
    """An RMSNorm's weight as row `row` of `table` `[N, hidden]` (a model's stacked norm
    weights), which a kernel reads in place: a slice passed to it would be copied."""

    table: jax.Array
    row: int

    @property
    def weight(self) -> jax.Array:
        return self.table[self.row]


class PeerTable(nnx.Variable):
    """The GPUs' workspace addresses `[2, ranks]` int32 (low, high words): no weight."""


class RowReduce(nnx.Module):
    """Sums a row-parallel product's shards over 'model' for the steps `takes` accepts.

    `mode` "peer": the peer kernel; "psum": `lax.psum` (the same route, for tests).
    `norm_table`: the workspace addresses of the add-norm kernel's calls, whose rows
    are `norm_words` 32-bit words (None, 0: no such calls).
    """

    def __init__(self, mesh: Mesh, mode: str, table: jax.Array,
                 norm_table: jax.Array | None = None, norm_words: int = 0):
        if mode not in ("peer", "psum"):
            raise ValueError(f"mode {mode!r} is not 'peer' or 'psum'")
        self.mesh = mesh
        self.mode = mode
        self.ranks = mesh.shape[AXIS]
        self.table = PeerTable(table)
        self.norm_words = norm_words if norm_table is not None else 0
        self.norm_table = PeerTable(norm_table) if self.norm_words else None
        self.split_k = int(os.environ.get(SPLIT_K_ENV, SPLIT_K))

    def cache_key(self) -> list:
        """What the programs traced with this reduce depend on (the program cache's key)."""
        from pallas_kernels.peer_allreduce import add_norm, gpu

        return [self.mode, gpu.CHUNK, gpu.MAX_WORDS, self.norm_words, add_norm.MAX_ROWS,
                self.split_k]

    def parts(self, width: int) -> int:
        """How many float32 partials a product add-normed here splits its contraction of
        `width` (one device's) into: 0 for one product in the model dtype."""
        return split_count(width, self.split_k)

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

    def takes_add_norm(self, rows: int, cols: int, dtype: Any) -> bool:
        """Whether a `[rows, cols]` sum of `dtype` may take `product_add_norm`: rows of
        this reduce's width that the add-norm kernel takes, in either mode."""
        from pallas_kernels.peer_allreduce import add_norm

        return (self.norm_words > 0 and add_norm.row_words(cols, dtype) == self.norm_words
                and add_norm.supported(rows, cols, dtype))

    def product_add_norm(self, fn: Callable[..., jax.Array], args: Sequence[jax.Array],
                         in_specs: Sequence[P], residual: jax.Array, norm: NormWeight,
                         eps: float, offset: bool) -> tuple[jax.Array, jax.Array]:
        """`x = residual + product(fn, args, in_specs)` and its RMSNorm by `norm`, both
        whole on every device."""
        def body(table, residual, weights, *local):
            partial = fn(*local)  # [T, N], or float32 partials [S, T, N]
            if self.mode == "psum":
                if partial.ndim == 3:
                    partial = partial.sum(0).astype(residual.dtype)
                x = residual + jax.lax.psum(partial, AXIS)
                return x, rms_norm(x, weights[norm.row], eps, offset)
            from pallas_kernels.peer_allreduce import add_norm

            return add_norm.all_reduce_add_norm(partial, residual, weights, norm.row, eps,
                                                offset, table, AXIS, self.ranks)

        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P(), P(), *in_specs),
                             out_specs=(P(), P()), check_vma=False)(
            self.norm_table[...], residual, norm.table, *args)


@dataclasses.dataclass(frozen=True)
class _Shard:
    """A `Linear`'s parameters as one device holds them, for its method's `apply`."""

    in_dims: int
    weight: jax.Array
    weight_scale: jax.Array | None = None
    input_scale: jax.Array | None = None
    bias: None = None  # added once, after the sum


def _linear_shards(layer: Any, x: jax.Array, add_norm: bool = False
                   ) -> tuple[Callable[..., jax.Array], list, list] | None:
    """A row-parallel `Linear`'s product as a reduce's `product` (or, `add_norm`,
    `product_add_norm`) takes it: the function of one device's shards, its arguments and
    their specs; None where the layer keeps XLA's all-reduce (no reduce, an adapter
    attached, a step the reduce's `takes` or `takes_add_norm` refuses). For the add-norm
    kernel a plain weight's product is the float32 partials of `reduce.parts`
    (`split_partials`), where that is not 0."""
    if layer.reduce is None or layer.lora is not None:
        return None
    takes = layer.reduce.takes_add_norm if add_norm else layer.reduce.takes
    w = layer.weight[...]
    out_dims = w.ndim - layer.in_dims
    if not takes(x.shape[0], int(np.prod(w.shape[:out_dims])), x.dtype):
        return None
    spec = tuple(layer.spec) + (None,) * (w.ndim - len(layer.spec))
    # The weight and whatever scales its method holds, each split as it is stored.
    parts = {"weight": P(*spec), "weight_scale": P(*spec[:out_dims]), "input_scale": P()}
    names = [n for n in parts if getattr(layer, n, None) is not None]

    def local(x, *arrays):
        shard = _Shard(layer.in_dims, **dict(zip(names, arrays, strict=True)))
        s = layer.reduce.parts(int(np.prod(shard.weight.shape[out_dims:]))) if add_norm else 0
        if s and layer.plain:
            return split_partials(x, shard.weight, s)
        return layer.method.apply(shard, x)

    return (local, [x, *(getattr(layer, n)[...] for n in names)],
            [P(None, *spec[out_dims:]), *(parts[n] for n in names)])


def linear_product(layer: Any, x: jax.Array) -> jax.Array | None:
    """`layer(x)` for a row-parallel `Linear` whose `reduce` takes the step, its shards
    summed by it; None where the layer keeps XLA's all-reduce."""
    shards = _linear_shards(layer, x)
    if shards is None:
        return None
    out = layer.reduce.product(*shards)
    return out if layer.bias is None else out + layer.bias[...]


def linear_add_norm(layer: Any, x: jax.Array, residual: jax.Array, norm: NormWeight,
                    eps: float, offset: bool) -> tuple[jax.Array, jax.Array] | None:
    """`residual + layer(x)` and its RMSNorm in one kernel with the sum, for an unbiased
    row-parallel `Linear` whose `reduce` takes the step that way; None elsewhere."""
    if layer.bias is not None or residual.dtype != x.dtype:
        return None
    shards = _linear_shards(layer, x, add_norm=True)
    if shards is None:
        return None
    return layer.reduce.product_add_norm(*shards, residual, norm, eps, offset)


def split_count(width: int, parts: int) -> int:
    """`parts` where it cuts a contraction of `width` into equal slices of at least
    `MIN_SPLIT_WIDTH`, else 0 (one product in the model dtype)."""
    return parts if parts > 1 and width % parts == 0 and width // parts >= MIN_SPLIT_WIDTH else 0


def split_partials(x: jax.Array, w: jax.Array, parts: int) -> jax.Array:
    """`x [T, *in] @ w [*out, *in].T` as float32 partials `[parts, T, *out]` over
    `parts` equal slices of the contraction: one batched GEMV through a view of the
    stored weight (no copy), whose partials the consumer's kernel adds (the add-norm
    peer sum, qkv_rope), instead of XLA's split-K GEMV and its separate sum."""
    t, k = x.shape[0], int(np.prod(x.shape[1:]))
    out = w.shape[:w.ndim - (x.ndim - 1)]
    w = w.reshape(*out, parts, k // parts)
    return jnp.einsum("tsk,...sk->st...", x.reshape(t, parts, k // parts), w,
                      preferred_element_type=jnp.float32)


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
    reduce = (make(mesh, _norm_words(model)) if hasattr(model, "attach_row_reduce")
              else None)
    if reduce is not None:
        model.attach_row_reduce(reduce)
    return reduce


def _norm_words(model: nnx.Module) -> int:
    """The add-norm kernel's row width for `model`'s residual stream, in 32-bit words
    (0: a width it refuses, a model without a decoder's shape, or the knob off)."""
    from pallas_kernels.peer_allreduce import add_norm

    arch, table = getattr(model, "arch", None), getattr(model, "embed_tokens", None)
    if os.environ.get(ADD_NORM_ENV, "1") == "0" or arch is None or table is None:
        return 0
    return add_norm.row_words(arch.hidden_size, table[...].dtype)


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


def make(mesh: Mesh | None, norm_words: int = 0) -> RowReduce | None:
    """The `RowReduce` for `mesh` (None: XLA's all-reduce, see `mode_for`), with the
    add-norm kernel's calls for rows of `norm_words` words (0: none). The peer
    workspaces are allocated once a process (the add-norm calls' one per row width);
    GPUs that cannot reach each other's memory keep XLA's all-reduce, with a warning."""
    mode = None if mesh is None else mode_for(mesh)
    if mode is None:
        return None
    if mode == "psum":
        table = jax.device_put(np.zeros((2, mesh.shape[AXIS]), np.int32),
                               NamedSharding(mesh, P()))
        return RowReduce(mesh, mode, table, table if norm_words else None, norm_words)
    ws = _workspace(mesh, 0)
    if ws is None:
        return None
    rows = _workspace(mesh, norm_words) if norm_words else None
    return RowReduce(mesh, mode, ws.table, None if rows is None else rows.table, norm_words)


def _workspace(mesh: Mesh, norm_words: int) -> Any:
    """The peer workspace of `mesh`: the chunked sums' (`norm_words` 0) or the add-norm
    calls' of that row width; None where the GPUs cannot reach each other."""
    from pallas_kernels.peer_allreduce import gpu

    key = (tuple(d.id for d in mesh.devices.flat), norm_words)
    if key not in _WORKSPACES:
        try:
            _WORKSPACES[key] = gpu.Workspace(mesh, AXIS)
        except (OSError, RuntimeError) as e:
            logger.warning("peer all-reduce off, XLA's all-reduce instead: %s", e)
            _WORKSPACES[key] = None
    return _WORKSPACES[key]
