"""Ahead-of-time compilation of the engine's step programs for a TPU slice, with no TPU.

`compile_programs(config, devices)` builds what `ModelRunner` builds on those
devices: the model graph (Pallas TPU attention body on a TPU), the bucketed
forward, sampler and prompt-logprobs programs (the runner's own jitted functions,
`programs.step_functions` and the staged sampler), and the paged KV cache sized as
`kv_cache.PagedKVCache` sizes it against the chip's HBM. The arguments are
abstract (`ShapeDtypeStruct`s sharded over the devices), so no weight is ever
materialized, and every program is lowered and compiled: for compile-only TPU
devices (`distributed/tpu_topology.py`) that runs libtpu's compiler, Mosaic
included. Each program reports its compile time and `memory_analysis()` bytes.

Programs go through the same caches as the runner's precompile (the jaxllm-aot
program files and JAX's persistent compilation cache under
`compilation_cache_dir`); BENCHMARKS.md ("TPU (compiled, not run)") says which
parts of their keys a TPU VM shares with this host and which only it can check.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import EngineConfig
from jaxllm.distributed.mesh import (
    kv_cache_sharding,
    make_mesh,
    param_shardings,
    variable_sharding,
)
from jaxllm.distributed.tpu_topology import hbm_bytes_per_device
from jaxllm.errors import ParameterError
from jaxllm.layers.mlp import SwiGLU, get_swiglu
from jaxllm.models.loader import abstract_model, kv_cache_spec
from jaxllm.quant_config import kv_cache_dtype
from jaxllm.sample.metadata import SamplingMetadata, variant_metadata
from jaxllm.sample.output_state import OutputState
from jaxllm.sample.staged import STAGED, is_plain
from jaxllm.worker.aot_cache import ExecutableCache
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.kv_cache import PagedKVCache, activation_reserve, model_kv_groups
from jaxllm.worker.programs import (
    PROMPT_LOGPROBS_ROWS,
    aot_context,
    enable_compilation_cache,
    out_buffer_specs,
    step_functions,
)
from jaxllm.worker.step_inputs import pack_step_inputs

logger = logging.getLogger(__name__)

GiB = 1 << 30
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One compiled program: what `memory_analysis()` says, per chip."""

    name: str  # forward | logits | sample[mode] | adjust | draw | logprobs | prompt_logprobs
    bucket: int  # token bucket (forward, prompt_logprobs) or request bucket
    compile_seconds: float  # wall clock
    compile_cpu_seconds: float  # this process's CPU time (every thread): load-independent
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int  # with the weights and KV cache that stay resident beside it
    optimal_seconds: float | None  # the compiler's own estimate; never a measurement

    def line(self) -> str:
        estimate = ("" if self.optimal_seconds is None else
                    f" (the compiler's estimate: {self.optimal_seconds * 1e3:.3f} ms a run)")
        return (f"{self.name}[{self.bucket}]: compiled in {self.compile_seconds:.1f}s "
                f"(CPU {self.compile_cpu_seconds:.1f}s); "
                f"argument {_gib(self.argument_bytes)}, temp {_gib(self.temp_bytes)}, "
                f"output {_gib(self.output_bytes)} GiB{estimate}")


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Every program of one engine configuration, and the chip memory they share."""

    target: str
    programs: list[ProgramReport]
    hbm_bytes_per_chip: int
    weight_bytes_per_chip: int
    kv_cache_bytes_per_chip: int
    num_kv_blocks: int  # usable blocks (the reserved null block not counted)
    block_size: int
    activation_reserve_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(p.peak_bytes for p in self.programs)

    def summary(self) -> str:
        return (f"compiled {len(self.programs)} programs for {self.target}: peak HBM "
                f"{_gib(self.peak_bytes)} GiB of {_gib(self.hbm_bytes_per_chip)} GiB per chip")


class ProgramCompileError(RuntimeError):
    """A program the target's compiler rejects, or that does not fit its memory."""


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _shard_bytes(spec: jax.ShapeDtypeStruct) -> int:
    """Bytes of one device's shard of `spec`."""
    shape = spec.sharding.shard_shape(spec.shape) if spec.sharding is not None else spec.shape
    return int(np.prod(shape)) * jnp.dtype(spec.dtype).itemsize


def _abstract(x: Any, sharding: NamedSharding | None = None) -> jax.ShapeDtypeStruct:
    """`x`'s shape and dtype, placed by `sharding` (None: as jit places a host array)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


def _swiglu_for(config: EngineConfig, dtype: Any, mesh: jax.sharding.Mesh) -> SwiGLU:
    """The MLP the runner picks on the target: on a TPU no kernel applies, as on any
    non-Hopper device ("auto" -> plain XLA)."""
    if mesh.devices.flat[0].platform != "tpu":
        return get_swiglu(config.mlp_backend, config.mlp_interpret, dtype=dtype, mesh=mesh)
    if config.mlp_backend not in ("auto", "xla"):
        raise ParameterError("mlp_backend", f"{config.mlp_backend!r} runs on a Hopper GPU; a "
                             "TPU takes 'auto' or 'xla'")
    return SwiGLU(config.mlp_backend)


def _attention_for(config: EngineConfig, platform: str) -> Any:
    """The backend `get_attention_backend` picks on the target's platform."""
    if platform != "tpu":
        from jaxllm.layers.attention import get_attention_backend

        return get_attention_backend(config.attention_backend, config.attention_interpret)
    if config.attention_backend not in ("auto", "pallas_tpu"):
        raise ParameterError("attention_backend", f"{config.attention_backend!r} does not run "
                             "on a TPU; use 'auto' or 'pallas_tpu'")
    from jaxllm.layers.attention_pallas import PallasTPUBackend

    return PallasTPUBackend(interpret=False)


class _Compiler:
    """Compiles programs one by one, recording each (or failing with its name)."""

    def __init__(self, target: str, hbm: int, resident: int,
                 on_program: Callable[[ProgramReport], None] | None):
        self.target, self.hbm, self.resident = target, hbm, resident
        self.reports: list[ProgramReport] = []
        self.on_program = on_program

    def run(self, name: str, bucket: int, build: Callable[[], tuple[Any, Any]],
            resident_args: int) -> Any:
        """`build()` -> (compiled program, its abstract outputs), which this returns;
        `resident_args`: bytes per chip of its arguments that are weights or the KV
        cache (resident whether it runs or not)."""
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            compiled, outputs = build()
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            verdict = ("does not fit" if "RESOURCE_EXHAUSTED" in first
                       else "does not compile for")
            raise ProgramCompileError(f"{name}[{bucket}] {verdict} {self.target}: "
                                      f"{first}") from e
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        mem = compiled.memory_analysis()
        arg, out = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
        temp, alias = int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)
        peak = arg + out + temp - alias + max(self.resident - resident_args, 0)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) and cost else cost
        optimal = (cost or {}).get("optimal_seconds") if isinstance(cost, dict) else None
        report = ProgramReport(name, bucket, seconds, cpu, arg, out, temp, alias, peak,
                               None if optimal is None else float(optimal))
        self.reports.append(report)
        if self.on_program is not None:
            self.on_program(report)
        if self.hbm and peak > self.hbm:
            raise ProgramCompileError(
                f"{name}[{bucket}] does not fit {self.target}: it needs {_gib(peak)} GiB per "
                f"chip (weights, KV cache, its arguments, temporaries and outputs) of "
                f"{_gib(self.hbm)} GiB; lower --hbm-utilization, --max-num-batched-tokens or "
                f"--max-num-seqs, or raise --tensor-parallel-size")
        return outputs


def compile_programs(config: EngineConfig, devices: Sequence[jax.Device], target: str, *,
                     on_program: Callable[[ProgramReport], None] | None = None
                     ) -> CompileReport:
    """Compiles every program a runner on `devices` precompiles (see module doc)."""
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    pc = config.parallel_config
    if pc.tensor_parallel_size > len(devices):
        raise ParameterError("tensor_parallel_size",
                             f"{pc.tensor_parallel_size} exceeds the {len(devices)} chips of "
                             f"{target}")
    platform = devices[0].platform
    mesh = make_mesh(pc.tensor_parallel_size, list(devices), hf_config=mc.hf_config)
    xla_cache_dir = enable_compilation_cache(config.compilation_cache_dir)
    dtype = _DTYPES[mc.dtype]
    attn = _attention_for(config, platform)
    swiglu = _swiglu_for(config, dtype, mesh)
    model = abstract_model(mc, mesh, attn, swiglu)
    graphdef, state = nnx.split(model)
    # The weights as the runner holds them (a flat list), abstract and placed.
    nnx.replace_by_pure_dict(state, jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(state), param_shardings(state, mesh)))
    weights = jax.tree.leaves(state)
    head_var = model.logits_head
    head = jax.ShapeDtypeStruct(head_var.shape, head_var.dtype,
                                sharding=variable_sharding(head_var, mesh))
    weight_bytes = sum(_shard_bytes(w) for w in weights)

    groups = model_kv_groups(model)
    b = Buckets.make(sc.max_num_batched_tokens, sc.max_num_seqs, mc.max_model_len,
                     cc.block_size, config.token_buckets, config.request_buckets,
                     groups.num_groups)
    num_layers, num_kv_heads, head_dim = kv_cache_spec(mc.hf_config, pc.tensor_parallel_size)
    kv_dtype = jnp.dtype(kv_cache_dtype(mc))
    kv = PagedKVCache(attn, mesh, num_layers, num_kv_heads, head_dim, cc.block_size, kv_dtype,
                      groups=groups)
    reserve = activation_reserve(mc.hf_config, b.token_buckets[-1], b.request_buckets[-1],
                                 mc.vocab_size, dtype, PROMPT_LOGPROBS_ROWS, sc.max_num_seqs,
                                 bucket_tokens=sum(b.token_buckets))
    hbm = hbm_bytes_per_device(devices[0]) if platform == "tpu" else 0
    # What the runner reads from the device once the weights are loaded.
    stats = {"bytes_limit": hbm, "bytes_in_use": weight_bytes} if hbm else None
    num_blocks = kv.num_blocks(cc, sc.max_num_seqs, mc.max_model_len, lambda: reserve,
                               memory_stats=stats, max_chunk=sc.max_num_batched_tokens)
    cache_shape = attn.kv_cache_shape(kv.pages_per_block * num_blocks, cc.block_size,
                                      num_kv_heads, head_dim)
    kv_cache = jax.ShapeDtypeStruct(cache_shape, kv_dtype,
                                    sharding=kv_cache_sharding(mesh, attn))
    kv_bytes = _shard_bytes(kv_cache)
    resident = weight_bytes + kv_bytes

    aot = ExecutableCache.create(xla_cache_dir, aot_context(config, attn, swiglu, mesh),
                                 list(mesh.devices.flat))
    replicated = NamedSharding(mesh, P())
    forward, sample_fn, logits_fn, prompt_logprobs, forward_core = step_functions(
        graphdef, jax.tree.structure(state), model.head_logits, b.max_num_seqs,
        b.max_blocks_per_req, b.num_kv_groups, outputs_sharding=replicated)
    no_prev = jax.ShapeDtypeStruct((b.max_num_seqs,), jnp.int32, sharding=replicated)
    compiler = _Compiler(target, hbm, resident, on_program)

    def packed(t: int) -> jax.ShapeDtypeStruct:
        return _abstract(pack_step_inputs(t, b.max_num_seqs, b.max_blocks_per_req,
                                          b.num_kv_groups)[0])

    def compile_step(name: str, fn: Any, args: tuple, **kw: Any) -> tuple[Any, Any]:
        """(compiled, abstract outputs) through the program cache, as the runner does."""
        program = aot.load_or_compile(name, fn, args, **kw) if aot else None
        if program is None:
            compiled = fn.lower(*args).compile()
            return compiled, compiled.out_info
        return program.compiled, program.out_tree.unflatten(
            jax.tree.leaves(program.compiled.out_info))

    # Each program takes the KV cache as the one before it left it (as in the runner's
    # precompile, where every forward returns the donated cache): its placement is
    # part of what a compiled program expects.
    outputs = {}
    for t in b.token_buckets:
        args = (weights, kv_cache, packed(t), no_prev)
        args += (out_buffer_specs(forward_core, args, replicated),)
        outputs[t] = compiler.run("forward", t, lambda args=args: compile_step(
            "forward", forward, args, donate_argnums=(1, 4)), resident)
        kv_cache = outputs[t][0]
    last_hidden, out_index = outputs[b.token_buckets[-1]][2:4]
    for r in b.request_buckets:
        _compile_sampler(compiler, r, b.max_num_seqs, mc.vocab_size, head, last_hidden,
                         out_index, logits_fn, sample_fn, replicated, _shard_bytes(head))
    for t in b.token_buckets:
        args = (weights, kv_cache, packed(t), outputs[t][1], _abstract(np.zeros(t, np.int32)))
        compiler.run("prompt_logprobs", t, lambda args=args: compile_step(
            "prompt_logprobs", prompt_logprobs, args), resident)
    return CompileReport(target, compiler.reports, hbm, weight_bytes, kv_bytes,
                         num_blocks - 1, cc.block_size, reserve)


def _with_outputs(compiled: Any) -> tuple[Any, Any]:
    return compiled, compiled.out_info


def _variant(md: SamplingMetadata, mode: bool = True) -> str:
    """The sampler variant `md` selects, as text (greedy, top_k_top_p, penalties, ...)."""
    parts = [n for n, on in (("fixed", md.fixed is not None),
                             ("history", md.history is not None),
                             ("token_bitmask", md.token_bitmask is not None)) if on]
    if mode:
        parts.insert(0, "greedy" if md.all_greedy else
                     ("top_k_top_p" if md.use_top_k_top_p else "random"))
    return "+".join(parts)


def _compile_sampler(compiler: _Compiler, r: int, size: int, vocab_size: int, head: Any,
                     last_hidden: Any, out_index: Any, logits_fn: Any, sample_fn: Any,
                     replicated: NamedSharding, head_bytes: int) -> None:
    """The request bucket's logits and one-program samplers, then the staged sampler's
    stages, for every variant the runner precompiles."""
    put = lambda x: jax.tree.map(lambda a: _abstract(a, replicated), x)  # noqa: E731
    tables = OutputState(size, vocab_size)  # the runner's output tables, as placed
    tables.device_put = put
    variants = list(variant_metadata(r, vocab_size, put, out_index, tables.tables))
    variants = [jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct)
                             else _abstract(a), md) for md in variants]
    logits = compiler.run("logits", r, lambda: _with_outputs(logits_fn.lower(
        head, last_hidden, rows=r).compile()), head_bytes)
    for md in variants:
        if is_plain(md):
            compiler.run(f"sample[{_variant(md)}]", r, lambda md=md: _with_outputs(
                sample_fn.lower(head, last_hidden, md, size=size).compile()), head_bytes)

    def compile_stage(name: str, fn: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(args[1], SamplingMetadata):  # adjust and draw: one per variant
            name += f"[{_variant(args[1], mode=name != 'adjust_logits')}]"
        return compiler.run(name, r, lambda: _with_outputs(fn.lower(*args, **kw).compile()), 0)

    STAGED.precompile(logits, variants, size, call=compile_stage)
