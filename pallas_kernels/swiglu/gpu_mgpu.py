"""The SwiGLU up-projection as one Pallas Mosaic GPU (Hopper) kernel.

`swiglu_up(x, w)` is `silu(x @ w[0].T) * (x @ w[1].T)` for `x [T, H]` and the
stacked gate/up weight `w [2, I, H]` (the model's layout, Hugging Face's `[out,
in]` rows); `reference.py` is the oracle. The point is the epilogue: the GEMM
never writes its `[T, 2I]` gate/up product. Each warpgroup's float32
accumulator holds the gate and the up columns of the same output columns, and
it writes `silu(gate) * up` straight from registers, so the separate SiLU·mul
pass (a read of `[T, 2I]` and a write of `[T, I]`) is gone.

Shape of the work:

* A CTA computes a `2 * block_m` x `block_n` output tile: two consumer
  warpgroups of `block_m` rows each, plus one producer warpgroup issuing the TMA
  copies (`plgpu.emit_pipeline_warp_specialized`, `num_stages` deep).
* Per K step the CTA loads `x[rows, k]` (`2 * block_m` x `block_k`) and the
  weight block `w[:, cols, k]` (`2 x block_n x block_k`): the gate rows and the
  up rows of its output columns, one 3-D TMA box, so no interleaved copy of the
  weight is ever made. Each consumer runs two `block_m x block_n` wgmmas per K
  step, into a gate and an up accumulator (one `2 * block_n`-wide wgmma over the
  block viewed as 2-D would need a reshape of the tiled shared-memory ref, which
  Mosaic GPU does not lower).
* Persistent: one CTA per SM walks the output tiles in a planar snake (tiles
  `grid_tile_width` wide along the minor dimension), so neighbouring CTAs share
  x and weight blocks in L2. With `cluster_n = 2` two CTAs of a cluster take
  neighbouring column tiles of the same rows and x is multicast to both.

Fast path (`supported()`): a Hopper GPU (or `interpret=True`, Mosaic GPU
interpret mode on the CPU, for tests), x and w both bfloat16 or both float16
(interpret mode also takes float32), `T % (2 * block_m) == 0`,
`I % (block_n * cluster_n) == 0`, `H % block_k == 0`. Anything else is the
caller's to compute with XLA (`jaxllm.models.llama.LlamaMLP` does).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Mosaic GPU is part of jax proper, but keep the module importable without it.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except Exception:  # pragma: no cover
    plgpu = None

LOG2E = math.log2(math.e)
NUM_CONSUMERS = 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int = 128  # rows per consumer warpgroup (the CTA takes 2 x block_m)
    block_n: int = 64  # output columns per CTA (gate block_n + up block_n in the wgmma)
    block_k: int = 64  # 128 bytes of bf16: one 128B-swizzled row
    num_stages: int = 4
    cluster_n: int = 2  # CTAs per cluster along the output columns (x multicast)
    grid_minor_n: bool = True  # snake minor dimension: columns (True) or rows
    grid_tile_width: int = 8


def supported(x: jax.Array, w: jax.Array, *, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> bool:
    """Whether the kernel covers `swiglu_up(x, w)` (see the module docstring)."""
    if plgpu is None or x.ndim != 2 or w.ndim != 3 or w.shape[0] != 2:
        return False
    bs = block_sizes or BlockSizes()
    (t, h), (_, i, h2) = x.shape, w.shape
    if h != h2 or x.dtype != w.dtype:
        return False
    dtypes = [jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)]
    if interpret:
        dtypes.append(jnp.dtype(jnp.float32))
    if jnp.dtype(x.dtype) not in dtypes:
        return False
    if t % (NUM_CONSUMERS * bs.block_m) or i % (bs.block_n * bs.cluster_n) or h % bs.block_k:
        return False
    return True if interpret else _is_hopper()


@functools.cache
def _is_hopper() -> bool:
    try:
        dev = jax.devices()[0]
    except Exception:  # pragma: no cover
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def _num_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except Exception:  # pragma: no cover
        return 132


def _kernel(x_gmem, w_gmem, out_gmem, *, bs: BlockSizes, interpret: bool):
    t, h = x_gmem.shape
    inter = w_gmem.shape[1]
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    cta_m = NUM_CONSUMERS * bm
    m_tiles = t // cta_m
    n_tiles = inter // (bn * bs.cluster_n)  # in cluster tiles
    k_steps = h // bk
    dtype = out_gmem.dtype
    multicast = bs.cluster_n > 1

    def transforms(dt):
        if interpret:  # the interpreter takes plain row-major buffers
            return ()
        swizzle = min(128, bk * jnp.dtype(dt).itemsize)
        return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dt).itemsize)),
                plgpu.SwizzleTransform(swizzle))

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_m, bk), lambda k: (0, k), transforms=transforms(dtype),
                                memory_space=plgpu.SMEM,
                                collective_axes=("cluster",) if multicast else ()),
                plgpu.BlockSpec((2, bn, bk), lambda k: (0, 0, k), transforms=transforms(dtype),
                                memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=NUM_CONSUMERS,
            max_concurrent_steps=bs.num_stages,
            compute_context=compute_context,
        )

    def nothing(*_, **__):
        return None

    epi_m = min(64, bm)  # rows per output store

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(nothing, nothing).get_allocations(x_gmem, w_gmem),
        out_smem=plgpu.SMEM((NUM_CONSUMERS, epi_m, bn), dtype, transforms=transforms(dtype)),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        cta_in_cluster = lax.axis_index("cluster") if multicast else 0

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="cluster_grid")
        def _tile_loop(info):
            (lin,) = info.index
            m_idx, n_cluster = plgpu.planar_snake(
                lin, (m_tiles, n_tiles), 1 if bs.grid_minor_n else 0, bs.grid_tile_width)
            n_idx = n_cluster * bs.cluster_n + cta_in_cluster
            rows = pl.ds(m_idx * cta_m, cta_m)
            cols = pl.ds(n_idx * bn, bn)
            wg_rows = pl.ds(wg * bm, bm)

            def epilogue(gate, up):
                act = gate / (1.0 + jnp.exp2(gate * -LOG2E)) * up
                for c in range(bm // epi_m):
                    # The previous store out of this buffer must have read it.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    out_smem[wg] = act[c * epi_m:(c + 1) * epi_m].astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[wg],
                        out_gmem.at[pl.ds(m_idx * cta_m + wg * bm + c * epi_m, epi_m), cols])

            def compute_context(run_pipeline):
                if interpret:  # float32 values as the carry (the interpreter has no ACC)
                    zeros = jnp.zeros((bm, bn), jnp.float32)
                    epilogue(*run_pipeline((zeros, zeros)))
                    return

                @functools.partial(pl.run_scoped, acc_g=plgpu.ACC((bm, bn), jnp.float32),
                                   acc_u=plgpu.ACC((bm, bn), jnp.float32))
                def _acc(acc_g, acc_u):
                    run_pipeline((acc_g, acc_u))
                    epilogue(acc_g[...], acc_u[...])

            def mma(_, x_smem, w_smem, carry):
                a = x_smem.at[wg_rows]
                if interpret:  # the interpreter's wgmma takes no transposed operands
                    def nt(b):
                        return lax.dot_general(a[...], b, (((1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32)
                    return carry[0] + nt(w_smem[0]), carry[1] + nt(w_smem[1])
                for acc, part in zip(carry, (0, 1), strict=True):  # gate, then up: `x @ w[part].T`
                    plgpu.wgmma(acc, a, w_smem.at[part].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return carry

            pipeline(mma, compute_context)(
                x_gmem.at[rows, :], w_gmem.at[:, cols, :], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def swiglu_up(x: jax.Array, w: jax.Array, *, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> jax.Array:
    """`silu(x @ w[0].T) * (x @ w[1].T)` `[T, I]` in `x.dtype`, float32 accumulation.

    The caller checks `supported()` first."""
    bs = block_sizes or BlockSizes()
    if not supported(x, w, interpret=interpret, block_sizes=bs):
        raise ValueError(f"swiglu_up: x {x.shape} {x.dtype} / w {w.shape} {w.dtype} is not "
                         f"covered by the kernel with {bs}")
    t, inter = x.shape[0], w.shape[1]
    num_tiles = (t // (NUM_CONSUMERS * bs.block_m)) * (inter // (bs.block_n * bs.cluster_n))
    num_clusters = min(num_tiles, (2 if interpret else _num_sms()) // bs.cluster_n)
    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        kw["interpret"] = interpret_params.InterpretGPUParams()
    sem = plgpu.LoweringSemantics.Warpgroup
    call = plgpu.kernel(
        functools.partial(_kernel, bs=bs, interpret=bool(interpret)),
        out_type=jax.ShapeDtypeStruct((t, inter), x.dtype),
        grid=(num_clusters,),
        grid_names=("cluster_grid",),
        cluster=(bs.cluster_n,),
        cluster_names=("cluster",),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=sem),
        **kw,
    )
    return call(x, w)
