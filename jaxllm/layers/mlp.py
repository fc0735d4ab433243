"""The SwiGLU up-projection, `silu(x @ w[0].T) * (x @ w[1].T)`, by XLA or by a fused kernel.

The gate/up weight is the model's `[2, I, H]` stack. XLA computes it as one
GEMM writing `[T, 2I]` and one elementwise pass reading that back to write
`[T, I]`. On a Hopper GPU, `pallas_kernels/swiglu` does the SiLU·mul in the
GEMM's epilogue instead, so the `[T, 2I]` product never reaches HBM. That pays
only in large steps (small ones are faster on cuBLAS; BENCHMARKS.md, kernels),
so "auto" sends only steps of at least `MIN_KERNEL_TOKENS` tokens to the kernel.
Steps whose shapes the kernel does not cover, and biased projections, stay on XLA.

Under tensor parallelism the weight is split over 'model' along I (column
parallel); the Pallas call is not partitioned by XLA, so it runs per shard in
`shard_map`, each shard producing its own columns of the output.

"pallas_gpu_mosaic" also sends `MatmulAdd` to a kernel: a projection plus the
residual it feeds (the attention's output projection, the MLP's down
projection), with the add in the GEMM's epilogue (`pallas_kernels/matmul_add`).
"auto" leaves those to XLA, since the throughput workload measured no gain from
the kernel. Those weights are row
parallel; under a split mesh their products are summed over 'model' before the
add, so there XLA computes them whatever the backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError

MLP_BACKENDS = ("auto", "xla", "pallas_gpu_mosaic")
# "auto": the kernel from this many tokens a step (see above).
MIN_KERNEL_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class SwiGLU:
    """`silu(x @ w[0].T) * (x @ w[1].T)` (+ bias before the SiLU), `[T, I]` in x's dtype.

    `kernel`: use the Mosaic GPU kernel where it covers the call and the step
    has at least `min_tokens` tokens. `mesh`: the weight's mesh when it is split
    over 'model' (the kernel then runs per shard).
    """

    name: str = "xla"
    kernel: bool = False
    interpret: bool = False
    min_tokens: int = 0
    mesh: Mesh | None = None

    def __call__(self, x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        if self.kernel and bias is None and x.shape[0] >= self.min_tokens:
            fused = self._fused(x, w)
            if fused is not None:
                return fused
        gate_up = jnp.einsum("th,sih->tsi", x, w)
        if bias is not None:
            gate_up = gate_up + bias
        return jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]

    @functools.cached_property
    def matmul_add(self) -> MatmulAdd:
        """The residual projections: the kernel with "pallas_gpu_mosaic" (see above)."""
        return MatmulAdd(self.kernel and self.name == "pallas_gpu_mosaic" and self.mesh is None,
                         self.interpret, self.min_tokens)

    @functools.cached_property
    def _kernel_call(self):
        """The kernel as one jitted function per SwiGLU: every layer's call is then the
        same nested program, lowered and compiled once per step shape rather than once
        per layer (per-layer call sites multiply a cold start's compile time)."""
        from pallas_kernels.swiglu import gpu_mgpu

        def run(x, w):
            return gpu_mgpu.swiglu_up(x, w, interpret=self.interpret)

        return jax.jit(run)

    def _fused(self, x: jax.Array, w: jax.Array) -> jax.Array | None:
        from pallas_kernels.swiglu import gpu_mgpu

        shards = 1 if self.mesh is None else self.mesh.shape["model"]
        if w.shape[1] % shards:
            return None
        local_w = jax.ShapeDtypeStruct((2, w.shape[1] // shards, w.shape[2]), w.dtype)
        if not gpu_mgpu.supported(x, local_w, interpret=self.interpret):
            return None

        run = self._kernel_call
        if shards == 1:
            return run(x, w)
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:  # jax < 0.7
            from jax.experimental.shard_map import shard_map
        return shard_map(run, mesh=self.mesh, in_specs=(P(), P(None, "model", None)),
                         out_specs=P(None, "model"), check_vma=False)(x, w)


@dataclasses.dataclass(frozen=True)
class MatmulAdd:
    """`residual + x @ w.T` (+ bias) for `x [T, K]`, `w [N, K]`, `residual [T, N]`.

    `kernel`: the Mosaic GPU kernel where it covers the call (no bias) and the step
    has at least `min_tokens` tokens; XLA otherwise. The kernel saves the
    elementwise add but its GEMM trails cuBLAS (its tile walk leaves the last wave
    half empty and the epilogue is not hidden behind the next tile's K loop), so it
    is opt-in.
    """

    kernel: bool = False
    interpret: bool = False
    min_tokens: int = 0

    def __call__(self, x: jax.Array, w: jax.Array, residual: jax.Array,
                 bias: jax.Array | None = None) -> jax.Array:
        if self.kernel and bias is None and x.shape[0] >= self.min_tokens:
            from pallas_kernels.matmul_add import gpu_mgpu

            if gpu_mgpu.supported(x, w, residual, interpret=self.interpret):
                return self._kernel_call(x, w, residual)
        out = jnp.einsum("tk,nk->tn", x, w)
        if bias is not None:
            out = out + bias
        return residual + out

    @functools.cached_property
    def _kernel_call(self):
        """One jitted function per MatmulAdd, as `SwiGLU._kernel_call` (every layer's
        call is the same nested program)."""
        from pallas_kernels.matmul_add import gpu_mgpu

        def run(x, w, residual):
            return gpu_mgpu.matmul_add(x, w, residual, interpret=self.interpret)

        return jax.jit(run)


def get_swiglu(name: str = "auto", interpret: bool = False, *, dtype=None,
               mesh: Mesh | None = None) -> SwiGLU:
    """The up-projection by backend name (`mlp_backend`).

    "auto": the kernel on a Hopper GPU for bfloat16 / float16 models, from
    `MIN_KERNEL_TOKENS` tokens a step; XLA otherwise. "pallas_gpu_mosaic": the
    kernel for every step it covers (Hopper, or `interpret` on any host).
    "xla": never the kernel.
    """
    if name not in MLP_BACKENDS:
        raise ParameterError("mlp_backend", f"must be one of {MLP_BACKENDS}, got {name!r}")
    split = mesh if mesh is not None and mesh.shape["model"] > 1 else None
    if name == "xla":
        return SwiGLU()
    from pallas_kernels.swiglu import gpu_mgpu

    hopper = gpu_mgpu.plgpu is not None and gpu_mgpu._is_hopper()
    if name == "pallas_gpu_mosaic":
        if not (hopper or interpret):
            raise ParameterError("mlp_backend", "'pallas_gpu_mosaic' runs on a Hopper GPU "
                                 f"(this process's devices are {jax.devices()[0].platform!r}); "
                                 "use 'auto' or 'xla'")
        return SwiGLU(name, True, bool(interpret), 0, split)
    half = dtype is None or jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if hopper and half:
        return SwiGLU("auto", True, False, MIN_KERNEL_TOKENS, split)
    return SwiGLU("auto")
