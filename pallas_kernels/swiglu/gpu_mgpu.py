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
  warpgroups of `block_m` rows each, and one producer warpgroup that issues the
  TMA copies into a ring of `num_stages` shared-memory stages ("loaded" and
  "consumed" barriers per stage; a stage is refilled once both consumers have
  released it).
* Per K step the producer copies `x[rows, k]` (`2 * block_m` x `block_k`) and
  the gate rows and the up rows of the CTA's output columns (`w[0, cols, k]`,
  `w[1, cols, k]`) into the two halves of one `2 * block_n`-row buffer, so the
  model's weight is read as it is (no interleaved copy) and each consumer runs
  one `block_m x 2 * block_n` wgmma per step, gate columns first.
* Persistent: one CTA per SM walks the output tiles in a planar snake (tiles
  `grid_tile_width` wide along the minor dimension), so CTAs running at the same
  time share x and weight blocks in L2. Producer and consumers walk the same
  tiles; the stage ring carries over from one tile to the next.
* Epilogue: from the float32 accumulator, `silu(gate) * up` in registers, then
  `EPI_ROWS`-row pieces through a staging buffer and TMA stores.

Measured on an H100 at 16384 x 4096 x 14336 (BENCHMARKS.md, throughput, stop 25):
within 2-3% of cuBLAS's GEMM alone, which writes `[T, 2I]` and leaves the
SiLU·mul pass to do. An earlier version on `plgpu.emit_pipeline_warp_specialized`
needed two 64-wide wgmmas per step (its 3-D weight block cannot be viewed as
2-D: Mosaic GPU does not fold an untiled axis into tiled rows) and ran ~3%
slower, clusters with x multicast included.

Fast path (`supported()`): a Hopper GPU (or `interpret=True`, Mosaic GPU
interpret mode on the CPU, for tests), x and w both bfloat16 or both float16
(interpret mode also takes float32), `T % (2 * block_m) == 0`,
`I % block_n == 0`, `H % block_k == 0`. Anything else is the caller's to
compute with XLA (`jaxllm.layers.mlp.SwiGLU` does).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu_util import is_hopper as _is_hopper
from pallas_kernels.mosaic_gpu_util import num_sms as _num_sms
from pallas_kernels.mosaic_gpu_util import plgpu, wait_last_releases

LOG2E = math.log2(math.e)
NUM_CONSUMERS = 2
EPI_ROWS = 64  # output rows per TMA store


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int = 128  # rows per consumer warpgroup (the CTA takes 2 x block_m)
    block_n: int = 64  # output columns per CTA (gate block_n + up block_n in the wgmma)
    block_k: int = 64  # 128 bytes of bf16: one 128B-swizzled row
    num_stages: int = 3
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
    if t % (NUM_CONSUMERS * bs.block_m) or i % bs.block_n or h % bs.block_k:
        return False
    return True if interpret else _is_hopper()






def _store_swiglu(gate, up, out_smem, out_gmem, row0, cols):
    """`silu(gate) * up` (float32 `[rows, n]`) to `out_gmem[row0:row0 + rows, cols]`,
    through one warpgroup's staging buffer `out_smem` (`[EPI_ROWS, n]`) and TMA stores."""
    act = gate / (1.0 + jnp.exp2(gate * -LOG2E)) * up
    for c in range(gate.shape[0] // EPI_ROWS):
        # The previous store out of this buffer must have read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[...] = act[c * EPI_ROWS:(c + 1) * EPI_ROWS].astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(row0 + c * EPI_ROWS, EPI_ROWS), cols])


def _transforms(dtype, block_k: int, interpret: bool):
    if interpret:  # the interpreter takes plain row-major buffers
        return ()
    swizzle = min(128, block_k * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _kernel(x_gmem, w_gmem, out_gmem, a_smem, b_smem, out_smem, full, free, *,
                   bs: BlockSizes, interpret: bool, num_ctas: int):
    t, h = x_gmem.shape
    inter = w_gmem.shape[1]
    bm, bn, bk, stages = bs.block_m, bs.block_n, bs.block_k, bs.num_stages
    cta_m = NUM_CONSUMERS * bm
    m_tiles, n_tiles, k_steps = t // cta_m, inter // bn, h // bk
    num_tiles = m_tiles * n_tiles
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")
    my_tiles = (num_tiles - cta + num_ctas - 1) // num_ctas
    i32 = jnp.int32

    def tile_coords(i):
        m_idx, n_idx = plgpu.planar_snake(cta + i * num_ctas, (m_tiles, n_tiles),
                                          1 if bs.grid_minor_n else 0, bs.grid_tile_width)
        return m_idx, n_idx

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")

        def tile(i, g0):
            m_idx, n_idx = tile_coords(i)
            rows = pl.ds(wg * bm, bm)

            def mma_steps(acc):
                def step(k, acc):
                    slot = lax.rem(g0 + k, i32(stages))
                    plgpu.barrier_wait(full.at[slot])
                    if interpret:  # the interpreter's wgmma takes no transposed operands
                        acc = acc + lax.dot_general(
                            a_smem[slot, rows], b_smem[slot], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
                    else:
                        plgpu.wgmma(acc, a_smem.at[slot, rows],
                                    b_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[slot])
                    return acc

                return lax.fori_loop(0, k_steps, step, acc)

            if interpret:
                acc = mma_steps(jnp.zeros((bm, 2 * bn), jnp.float32))
            else:
                def scope(acc_ref):
                    mma_steps(acc_ref)
                    return acc_ref[...]

                acc = pl.run_scoped(scope, plgpu.ACC((bm, 2 * bn), jnp.float32))
            _store_swiglu(acc[:, :bn], acc[:, bn:], out_smem.at[wg], out_gmem,
                          m_idx * cta_m + wg * bm, pl.ds(n_idx * bn, bn))
            return g0 + k_steps

        lax.fori_loop(0, my_tiles, tile, i32(0))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")

        def tile(i, g0):
            m_idx, n_idx = tile_coords(i)
            rows, cols = pl.ds(m_idx * cta_m, cta_m), pl.ds(n_idx * bn, bn)

            def step(k, _):
                g = g0 + k
                slot = lax.rem(g, i32(stages))

                @pl.when(g >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                ks = pl.ds(k * bk, bk)
                plgpu.copy_gmem_to_smem(x_gmem.at[rows, ks], a_smem.at[slot], full.at[slot])
                for part in (0, 1):  # gate rows, then up rows
                    plgpu.copy_gmem_to_smem(w_gmem.at[part, cols, ks],
                                            b_smem.at[slot, pl.ds(part * bn, bn)],
                                            full.at[slot])
                return ()

            lax.fori_loop(0, k_steps, step, ())
            return g0 + k_steps

        wait_last_releases(lax.fori_loop(0, my_tiles, tile, i32(0)), stages, free)


def swiglu_up(x: jax.Array, w: jax.Array, *, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> jax.Array:
    """`silu(x @ w[0].T) * (x @ w[1].T)` `[T, I]` in `x.dtype`, float32 accumulation.

    The caller checks `supported()` first."""
    bs = block_sizes or BlockSizes()
    if not supported(x, w, interpret=interpret, block_sizes=bs):
        raise ValueError(f"swiglu_up: x {x.shape} {x.dtype} / w {w.shape} {w.dtype} is not "
                         f"covered by the kernel with {bs}")
    t, inter = x.shape[0], w.shape[1]
    num_tiles = (t // (NUM_CONSUMERS * bs.block_m)) * (inter // bs.block_n)
    num_ctas = min(num_tiles, 2 if interpret else _num_sms())
    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        kw["interpret"] = interpret_params.InterpretGPUParams()
    dt, tr = x.dtype, _transforms(x.dtype, bs.block_k, interpret)
    call = plgpu.kernel(
        functools.partial(_kernel, bs=bs, interpret=bool(interpret), num_ctas=num_ctas),
        out_type=jax.ShapeDtypeStruct((t, inter), dt),
        scratch_types=[
            plgpu.SMEM((bs.num_stages, NUM_CONSUMERS * bs.block_m, bs.block_k), dt,
                       transforms=tr),  # x blocks
            plgpu.SMEM((bs.num_stages, 2 * bs.block_n, bs.block_k), dt,
                       transforms=tr),  # weight blocks: gate rows, then up rows
            plgpu.SMEM((NUM_CONSUMERS, EPI_ROWS, bs.block_n), dt,
                       transforms=_transforms(dt, bs.block_n, interpret)),  # output staging
            plgpu.Barrier(num_arrivals=3, num_barriers=bs.num_stages),  # stage loaded
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=bs.num_stages),  # consumed
        ],
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kw,
    )
    return call(x, w)
