"""The SwiGLU up-projection as one Pallas Mosaic GPU (Hopper) kernel.

`swiglu_up(x, w)` is `silu(x @ w[0].T) * (x @ w[1].T)` for `x [T, H]` and the
stacked gate/up weight `w [2, I, H]` (the model's layout, Hugging Face's `[out,
in]` rows); `reference.py` is the oracle. The point is the epilogue: the GEMM
never writes its `[T, 2I]` gate/up product. Each warpgroup's float32
accumulator holds the gate and the up columns of the same output columns, and
it writes `silu(gate) * up` straight from registers, so the separate SiLU·mul
pass (a read of `[T, 2I]` and a write of `[T, I]`) is gone.

The GEMM is `pallas_kernels/gemm_mgpu.py`'s persistent, warp-specialized body with
its "silu_mul" epilogue: each consumer's one `block_m x 2 * block_n` wgmma per K
step takes the gate rows and the up rows of the same output columns (copied into
the two halves of one weight buffer, so the model's weight is read as it is).

It runs close to cuBLAS's GEMM alone, which writes `[T, 2I]` and leaves the
SiLU·mul pass to do (BENCHMARKS.md, kernels). The pipeline is written by hand
rather than with `plgpu.emit_pipeline_warp_specialized`, which gives each input
its own buffer: the 3-D gate/up weight block cannot be viewed as 2-D (Mosaic GPU
does not fold an untiled axis into tiled rows), so it needed two 64-wide wgmmas
per step, and ran slower, clusters with x multicast included.

Fast path (`supported()`): a Hopper GPU (or `interpret=True`, Mosaic GPU
interpret mode on the CPU, for tests), x and w both bfloat16 or both float16
(interpret mode also takes float32), `T % (2 * block_m) == 0`,
`I % block_n == 0` (64 by default), `H % block_k == 0`. Anything else is the
caller's to compute with XLA (`jaxllm.layers.mlp.SwiGLU` does).
"""

from __future__ import annotations

import jax

from pallas_kernels import gemm_mgpu
from pallas_kernels.gemm_mgpu import BlockSizes
from pallas_kernels.mosaic_gpu_util import is_hopper as _is_hopper  # noqa: F401  (mlp.py)
from pallas_kernels.mosaic_gpu_util import plgpu  # noqa: F401  (None without Mosaic GPU)

__all__ = ["BlockSizes", "supported", "swiglu_up"]


def supported(x: jax.Array, w: jax.Array, *, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> bool:
    """Whether the kernel covers `swiglu_up(x, w)` (see the module docstring)."""
    return gemm_mgpu.supported(x, w, epilogue="silu_mul", interpret=interpret,
                               block_sizes=block_sizes)


def swiglu_up(x: jax.Array, w: jax.Array, *, interpret: bool = False,
              block_sizes: BlockSizes | None = None) -> jax.Array:
    """`silu(x @ w[0].T) * (x @ w[1].T)` `[T, I]` in `x.dtype`, float32 accumulation.

    The caller checks `supported()` first; ValueError where it is False."""
    return gemm_mgpu.gemm(x, w, epilogue="silu_mul", interpret=interpret,
                          block_sizes=block_sizes)
