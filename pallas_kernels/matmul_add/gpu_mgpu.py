"""A projection with its residual add, `residual + x @ w.T`, as one Pallas Mosaic GPU kernel.

In a decoder layer the attention's output projection and the MLP's down
projection each feed a residual add. XLA runs the add as its own pass, after the
GEMM has written its product: a read of two `[T, N]` arrays and a write of one
(and XLA computes the add a second time inside the next RMSNorm's fusion). Here
the GEMM's epilogue adds the residual rows to the float32 accumulator and
writes only the sum; the residual's read hides under the GEMM's K loop.

`x [T, K]`, `w [N, K]` (the model's `[out, in]` layout) and `residual [T, N]`;
`reference.py` is the oracle. The GEMM is `pallas_kernels/gemm_mgpu.py`'s
persistent, warp-specialized body with its "add" epilogue (CTA tiles of
`2 * block_m` x `block_n`, 256 x 128 by default, 256 x 64 where N is not a
multiple of 128).

Fast path (`supported()`): a Hopper GPU (or `interpret=True`, Mosaic GPU
interpret mode on the CPU, for tests), x, w and the residual of one dtype,
bfloat16 or float16 (interpret mode also takes float32), `T % (2 * block_m) ==
0`, `N % block_n == 0`, `K % block_k == 0`. Anything else is
the caller's to compute with XLA (`jaxllm.layers.mlp.MatmulAdd` does).
"""

from __future__ import annotations

import jax

from pallas_kernels import gemm_mgpu
from pallas_kernels.gemm_mgpu import BlockSizes

__all__ = ["BlockSizes", "matmul_add", "supported"]


def default_block_sizes(n: int) -> BlockSizes:
    """128 output columns a CTA, or 64 where N is not a multiple of 128."""
    return BlockSizes(block_n=128 if n % 128 == 0 else 64)


def supported(x: jax.Array, w: jax.Array, residual: jax.Array, *, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> bool:
    """Whether the kernel covers `matmul_add(x, w, residual)` (see the module docstring)."""
    if w.ndim != 2 or residual.shape != (x.shape[0], w.shape[0]) or residual.dtype != x.dtype:
        return False
    return gemm_mgpu.supported(x, w[None], epilogue="add", interpret=interpret,
                               block_sizes=block_sizes or default_block_sizes(w.shape[0]))


def matmul_add(x: jax.Array, w: jax.Array, residual: jax.Array, *, interpret: bool = False,
               block_sizes: BlockSizes | None = None) -> jax.Array:
    """`residual + x @ w.T` `[T, N]` in `x.dtype`, float32 accumulation.

    The caller checks `supported()` first; ValueError where it is False."""
    if w.ndim != 2:
        raise ValueError(f"matmul_add: w must be [N, K], got {w.shape}")
    return gemm_mgpu.gemm(x, w[None], residual, epilogue="add", interpret=interpret,
                          block_sizes=block_sizes or default_block_sizes(w.shape[0]))
