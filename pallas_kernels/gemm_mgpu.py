"""A persistent, warp-specialized Hopper GEMM `x @ w.T` with a fused epilogue (Mosaic GPU).

The body behind `swiglu/gpu_mgpu.py` (SiLU·mul of a gate/up pair) and
`matmul_add/gpu_mgpu.py` (a residual added to a projection). `x` is `[T, K]`;
`w` is `[P, N, K]`, `P` weight parts in Hugging Face's `[out, in]` orientation,
read as the model stores them. What the epilogue does with the `P` products of an
output tile is the point of each kernel: the GEMM's own product never reaches HBM.

Shape of the work:

* A CTA computes a `2 * block_m` x `block_n` output tile: two consumer
  warpgroups of `block_m` rows each, and one producer warpgroup that issues the
  TMA copies into a ring of `num_stages` shared-memory stages ("loaded" and
  "consumed" barriers per stage; a stage is refilled once both consumers have
  released it).
* Per K step the producer copies `x[rows, k]` (`2 * block_m` x `block_k`) and,
  for each part, `w[part, cols, k]` into its `block_n`-row slice of one
  `P * block_n`-row buffer, so each consumer runs one `block_m x P * block_n`
  wgmma per step (part 0's columns first).
* Persistent: one CTA per SM walks the output tiles in a planar snake (tiles
  `grid_tile_width` wide along the minor dimension), so CTAs running at the same
  time share x and weight blocks in L2. Producer and consumers walk the same
  tiles; the stage ring carries over from one tile to the next.
* Epilogues, from the float32 accumulator:
  - "silu_mul" (`P == 2`): `silu(part 0) * part 1` in registers, then
    `EPI_ROWS`-row pieces through a staging buffer and TMA stores;
  - "add" (`P == 1`): `residual + product`. Each consumer starts the TMA copy of
    its residual rows into its staging buffer when it starts the tile, so the
    copy lands while the tile's K loop runs; the sum is written over the
    residual in that buffer and stored with one TMA copy.

Fast path (`supported()`): a Hopper GPU (or `interpret=True`, Mosaic GPU
interpret mode on the CPU, for tests), x and w both bfloat16 or both float16
(interpret mode also takes float32), `T % (2 * block_m) == 0`,
`N % block_n == 0`, `K % block_k == 0`. Anything else is the caller's to
compute with XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu_util import is_hopper, num_sms, plgpu, wait_last_releases

LOG2E = math.log2(math.e)
NUM_CONSUMERS = 2
EPI_ROWS = 64  # output rows per piece of an epilogue
EPILOGUES = {"silu_mul": 2, "add": 1}  # epilogue -> weight parts


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_m: int = 128  # rows per consumer warpgroup (the CTA takes 2 x block_m)
    block_n: int | None = None  # output columns per CTA; None: 128 // parts (wgmma 128 wide)
    block_k: int = 64  # 128 bytes of bf16: one 128B-swizzled row
    num_stages: int = 3
    grid_minor_n: bool = True  # snake minor dimension: columns (True) or rows
    grid_tile_width: int = 8

    def n(self, parts: int) -> int:
        return self.block_n or 128 // parts


def supported(x: jax.Array, w: jax.Array, *, epilogue: str, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> bool:
    """Whether the kernel covers `x [T, K]`, `w [P, N, K]` (see the module docstring)."""
    parts = EPILOGUES[epilogue]
    if plgpu is None or x.ndim != 2 or w.ndim != 3 or w.shape[0] != parts:
        return False
    bs = block_sizes or BlockSizes()
    (t, k), (_, n, k2) = x.shape, w.shape
    if k != k2 or x.dtype != w.dtype:
        return False
    dtypes = [jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)]
    if interpret:
        dtypes.append(jnp.dtype(jnp.float32))
    if jnp.dtype(x.dtype) not in dtypes:
        return False
    if t % (NUM_CONSUMERS * bs.block_m) or n % bs.n(parts) or k % bs.block_k:
        return False
    return True if interpret else is_hopper()


def _transforms(dtype, cols: int, interpret: bool):
    if interpret:  # the interpreter takes plain row-major buffers
        return ()
    swizzle = min(128, cols * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _store_silu_mul(acc, bn, buf, out_gmem, row0, cols):
    """`silu(acc[:, :bn]) * acc[:, bn:]` to `out_gmem[row0:, cols]` through the staging
    buffer `buf` (`[EPI_ROWS, bn]`), one TMA store per piece."""
    gate, up = acc[:, :bn], acc[:, bn:]
    act = gate / (1.0 + jnp.exp2(gate * -LOG2E)) * up
    for c in range(act.shape[0] // EPI_ROWS):
        # The previous store out of this buffer must have read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        buf[...] = act[c * EPI_ROWS:(c + 1) * EPI_ROWS].astype(buf.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, out_gmem.at[pl.ds(row0 + c * EPI_ROWS, EPI_ROWS), cols])


def _store_add(acc, buf, out_gmem, row0, cols):
    """`acc + buf` (the residual rows, `[block_m, bn]`) written over `buf`, then one TMA
    store to `out_gmem[row0:, cols]`."""
    for c in range(acc.shape[0] // EPI_ROWS):
        piece = pl.ds(c * EPI_ROWS, EPI_ROWS)
        total = acc[c * EPI_ROWS:(c + 1) * EPI_ROWS] + buf[piece].astype(jnp.float32)
        buf[piece] = total.astype(buf.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, out_gmem.at[pl.ds(row0, acc.shape[0]), cols])


def _kernel(*refs, bs: BlockSizes, epilogue: str, interpret: bool, num_ctas: int):
    parts = EPILOGUES[epilogue]
    if epilogue == "add":
        x_gmem, w_gmem, r_gmem, out_gmem, a_smem, b_smem, epi_smem, full, free, res_ready = refs
    else:
        x_gmem, w_gmem, out_gmem, a_smem, b_smem, epi_smem, full, free = refs
    t, k_dim = x_gmem.shape
    n = w_gmem.shape[1]
    bm, bn, bk, stages = bs.block_m, bs.n(parts), bs.block_k, bs.num_stages
    cta_m = NUM_CONSUMERS * bm
    m_tiles, n_tiles, k_steps = t // cta_m, n // bn, k_dim // bk
    num_tiles = m_tiles * n_tiles
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")
    my_tiles = (num_tiles - cta + num_ctas - 1) // num_ctas
    i32 = jnp.int32

    def tile_coords(i):
        return plgpu.planar_snake(cta + i * num_ctas, (m_tiles, n_tiles),
                                  1 if bs.grid_minor_n else 0, bs.grid_tile_width)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")

        def tile(i, g0):
            m_idx, n_idx = tile_coords(i)
            rows = pl.ds(wg * bm, bm)
            row0, cols = m_idx * cta_m + wg * bm, pl.ds(n_idx * bn, bn)
            if epilogue == "add":
                # The last tile's store out of the staging buffer must have read it
                # before the residual rows of this tile are copied in.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(r_gmem.at[pl.ds(row0, bm), cols], epi_smem.at[wg],
                                        res_ready.at[wg])

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
                acc = mma_steps(jnp.zeros((bm, parts * bn), jnp.float32))
            else:
                def scope(acc_ref):
                    mma_steps(acc_ref)
                    return acc_ref[...]

                acc = pl.run_scoped(scope, plgpu.ACC((bm, parts * bn), jnp.float32))
            if epilogue == "add":
                plgpu.barrier_wait(res_ready.at[wg])
                _store_add(acc, epi_smem.at[wg], out_gmem, row0, cols)
            else:
                _store_silu_mul(acc, bn, epi_smem.at[wg], out_gmem, row0, cols)
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
                for part in range(parts):
                    plgpu.copy_gmem_to_smem(w_gmem.at[part, cols, ks],
                                            b_smem.at[slot, pl.ds(part * bn, bn)],
                                            full.at[slot])
                return ()

            lax.fori_loop(0, k_steps, step, ())
            return g0 + k_steps

        wait_last_releases(lax.fori_loop(0, my_tiles, tile, i32(0)), stages, free)


def gemm(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, *, epilogue: str,
         interpret: bool = False, block_sizes: BlockSizes | None = None) -> jax.Array:
    """The epilogue of `x @ w[p].T` (float32 accumulation), `[T, N]` in `x.dtype`.

    "silu_mul": `silu(x @ w[0].T) * (x @ w[1].T)`; "add": `residual + x @ w[0].T`
    (`residual [T, N]` in `x.dtype`). Raises ValueError where `supported()` is False."""
    bs = block_sizes or BlockSizes()
    if not supported(x, w, epilogue=epilogue, interpret=interpret, block_sizes=bs):
        raise ValueError(f"{epilogue} GEMM: x {x.shape} {x.dtype} / w {w.shape} {w.dtype} is "
                         f"not covered by the kernel with {bs}")
    parts = EPILOGUES[epilogue]
    t, n = x.shape[0], w.shape[1]
    bn = bs.n(parts)
    if epilogue == "add" and (residual is None or residual.shape != (t, n)
                              or residual.dtype != x.dtype):
        raise ValueError(f"add GEMM: residual must be [{t}, {n}] {x.dtype}, got "
                         f"{None if residual is None else (residual.shape, residual.dtype)}")
    num_tiles = (t // (NUM_CONSUMERS * bs.block_m)) * (n // bn)
    num_ctas = min(num_tiles, 2 if interpret else num_sms())
    kw = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

        kw["interpret"] = interpret_params.InterpretGPUParams()
    dt, tr = x.dtype, _transforms(x.dtype, bs.block_k, interpret)
    epi_rows = bs.block_m if epilogue == "add" else EPI_ROWS
    scratch = [
        plgpu.SMEM((bs.num_stages, NUM_CONSUMERS * bs.block_m, bs.block_k), dt,
                   transforms=tr),  # x blocks
        plgpu.SMEM((bs.num_stages, parts * bn, bs.block_k), dt,
                   transforms=tr),  # weight blocks, one bn-row slice per part
        plgpu.SMEM((NUM_CONSUMERS, epi_rows, bn), dt,
                   transforms=_transforms(dt, bn, interpret)),  # epilogue staging
        plgpu.Barrier(num_arrivals=1 + parts, num_barriers=bs.num_stages),  # stage loaded
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=bs.num_stages),  # consumed
    ]
    if epilogue == "add":
        scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=NUM_CONSUMERS))  # residual in
    call = plgpu.kernel(
        functools.partial(_kernel, bs=bs, epilogue=epilogue, interpret=bool(interpret),
                          num_ctas=num_ctas),
        out_type=jax.ShapeDtypeStruct((t, n), dt),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kw,
    )
    return call(x, w) if residual is None else call(x, w, residual)
