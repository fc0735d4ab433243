"""The grouped matmul of the mixture-of-experts layer: rows sorted by expert, each run of
rows multiplied by its expert's weight, in one fixed-shape call.

Four bodies, one contract (`GroupedMatmul`):
  * "ragged_dot": `jax.lax.ragged_dot_general`, XLA's own op (GPU and CPU);
  * "pallas_gpu": a Pallas GPU (Triton) kernel, pallas_kernels/grouped_matmul_gpu/:
    each group's rows cut into tiles, each program multiplying one tile by a block of
    its group's weight read in place (on GPU, or in interpret mode);
  * "megablox": the Pallas TPU grouped-matmul kernel JAX ships
    (`jax.experimental.pallas.ops.tpu.megablox.gmm`), on TPU or in interpret mode;
  * "tiled": plain XLA for backends whose ragged_dot lowering computes every group
    for every row: each group's rows padded to whole tiles of `tm` rows, each tile
    multiplied by its group's weight in one batched matmul. The tile count is bounded
    statically (ceil(M / tm) plus one partial tile per non-empty group), so the
    shapes stay fixed; a tile gathers its group's weight, which at decode reads about
    the routed experts only.

Quantized experts (layers/quant.py) pass int8 / float8_e4m3fn operands and ask for
a float32 result to scale: ragged_dot and "tiled" take them as they are (XLA's
mixed or FP8 dot), "pallas_gpu" reads them as they are and upcasts each tile in the
kernel; megablox reads bfloat16 / float32 only, so it gets them upcast,
which is exact (int8 and e4m3 values are all bfloat16 values).

`default_grouped_matmul` picks megablox on TPU, "pallas_gpu" on GPU (XLA's GPU
ragged_dot computes every group for every row, and "tiled" copies a weight per tile)
and ragged_dot on the CPU; `JAXLLM_MOE_KERNEL` overrides it (a device benchmark's knob).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.errors import ParameterError

GROUPED_MATMULS = ("ragged_dot", "megablox", "tiled", "pallas_gpu")


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
    """`out[r] = lhs[r] @ rhs[g(r)].T` for rows sorted by group, `group_sizes[g]` rows each:
    `lhs [M, K]`, `rhs [G, N, K]` (`[out, in]` per group), `group_sizes [G]` int32 summing
    to at most M. Rows past the sum are unspecified (the kernel leaves them unwritten);
    callers mask them.

    `kernel`: one of GROUPED_MATMULS (see above); `interpret` runs the Pallas bodies
    (megablox, pallas_gpu) in Pallas interpret mode on any host. `tiling`: megablox's
    largest (rows, contraction, output columns) tile, cut down to the problem where it
    is smaller (rows in multiples of 16, bfloat16's sublane tile); "tiled" and
    "pallas_gpu" take their largest row tile from the first.
    """

    kernel: str = "ragged_dot"
    interpret: bool = False
    tiling: tuple[int, int, int] = (128, 128, 128)

    def __post_init__(self):
        if self.kernel not in GROUPED_MATMULS:
            raise ParameterError("kernel", f"must be one of {GROUPED_MATMULS}, "
                                 f"got {self.kernel!r}")

    def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                 out_dtype: jnp.dtype | None = None) -> jax.Array:
        out_dtype = lhs.dtype if out_dtype is None else out_dtype
        if self.kernel == "megablox":
            return self._megablox(lhs, rhs, group_sizes).astype(out_dtype)
        if self.kernel == "tiled":
            return self._tiled(lhs, rhs, group_sizes).astype(out_dtype)
        if self.kernel == "pallas_gpu":
            from pallas_kernels.grouped_matmul_gpu.gpu import grouped_matmul, supported

            if not supported(lhs, rhs):  # past int32 offsets: XLA's op, slow but exact
                return self._ragged_dot(lhs, rhs, group_sizes, out_dtype)
            return grouped_matmul(lhs, rhs, group_sizes, out_dtype=out_dtype,
                                  max_rows=self.tiling[0], interpret=self.interpret)
        return self._ragged_dot(lhs, rhs, group_sizes, out_dtype)

    @staticmethod
    def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                    out_dtype: jnp.dtype) -> jax.Array:
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims,
                                          preferred_element_type=jnp.float32
                                          ).astype(out_dtype)

    def _megablox(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        floats = (jnp.bfloat16, jnp.float32)
        if lhs.dtype not in floats or rhs.dtype not in floats:  # quantized operands
            operand = jnp.float32 if jnp.float32 in (lhs.dtype, rhs.dtype) else jnp.bfloat16
            lhs, rhs = lhs.astype(operand), rhs.astype(operand)
        m, k = lhs.shape
        n = rhs.shape[1]
        rows, depth, cols = self.tiling
        # The kernel tiles rows by tm, which must divide M; pad rows (outside every group).
        tm = min(rows, 16 * math.ceil(m / 16))
        padded = tm * math.ceil(m / tm)
        if padded != m:
            lhs = jnp.pad(lhs, ((0, padded - m), (0, 0)))
        out = gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32,
                  tiling=(tm, min(depth, k), min(cols, n)), transpose_rhs=True,
                  interpret=self.interpret)
        return out[:m]

    def _tiled(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        m, groups = lhs.shape[0], rhs.shape[0]
        # About one tile per expected group, so a decode step wastes few rows per tile.
        tm = int(min(self.tiling[0], max(8, 2 ** math.ceil(math.log2(max(1, m / groups))))))
        tiles = -(-m // tm) + min(groups, m)
        ends = jnp.cumsum(group_sizes)
        padded = -(-group_sizes // tm) * tm
        padded_starts = jnp.cumsum(padded) - padded
        rows = jnp.arange(m)
        group = jnp.searchsorted(ends, rows, side="right")  # `groups` past the last group
        inside = group < groups
        g = jnp.minimum(group, groups - 1)
        pos = jnp.where(inside, padded_starts[g] + rows - (ends[g] - group_sizes[g]), tiles * tm)
        x = jnp.zeros((tiles * tm, lhs.shape[1]), lhs.dtype).at[pos].set(lhs, mode="drop")
        tile_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * tm,
                                                  side="right"), groups - 1)
        out = jnp.einsum("tmk,tnk->tmn", x.reshape(tiles, tm, -1), rhs[tile_group],
                         preferred_element_type=jnp.float32)
        return out.reshape(tiles * tm, -1).at[pos].get(mode="fill", fill_value=0)


def default_grouped_matmul(mesh: Mesh | None = None) -> GroupedMatmul:
    """`JAXLLM_MOE_KERNEL` if set, else the megablox kernel on TPU, the Pallas GPU kernel
    on GPU and ragged_dot on the CPU (the platform of `mesh`'s devices, which an
    ahead-of-time TPU compile lends a CPU host; else of this process's)."""
    chosen = os.environ.get("JAXLLM_MOE_KERNEL")
    if chosen:
        if chosen not in GROUPED_MATMULS:
            raise ParameterError("JAXLLM_MOE_KERNEL", f"must be one of {GROUPED_MATMULS}, "
                                 f"got {chosen!r}")
        return GroupedMatmul(chosen)
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return GroupedMatmul({"tpu": "megablox", "gpu": "pallas_gpu"}.get(device.platform,
                                                                     "ragged_dot"))
