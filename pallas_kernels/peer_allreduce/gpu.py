"""A one-shot all-reduce of a small bfloat16 or float32 tensor over the GPUs of one process, as one
Pallas GPU kernel (Triton lowering) that writes into the other GPUs' memory by address.

A decode step's all-reduces carry a few KiB each, where NCCL's ring pays a fixed latency
several times the transfer; XLA's own alternatives pay a per-call exchange of the peers'
addresses (BENCHMARKS.md, Several GPUs). Here each GPU holds one persistent workspace,
allocated once; its address and every peer's are an argument of the program, so a call
costs one kernel launch.

The data carries its own arrival signal (Lamport's one-shot scheme, as TensorRT-LLM's
all-reduce uses it): every word of a receive buffer holds a sentinel, 0x80000000, until
a peer's word lands in it, and no word sent equals it: a float32 -0.0, or a -0.0 in the
high half of a bfloat16 pair, is sent as +0.0 (`sendable`; a sum changes only where
every rank holds that -0.0: +0.0 then). So a call needs no fence and no flag round trip,
only the stores and the reads that see them land:

1. each program (a chunk of the tensor) reads its call counter from this GPU's
   workspace: the call's epoch is the counter plus one, and the epoch modulo three picks
   one of three buffers; it puts the sentinel back into the buffer of its previous call;
2. it writes its chunk into that buffer's slot for this rank in every GPU's workspace
   (its own included);
3. it reads every rank's slot of its own buffer, all words at once so that the loads
   overlap in flight, until no word is the sentinel; sums the ranks in rank order in
   float32 (so every GPU gets the same bits); and stores the new counter.

Three buffers suffice: a rank runs at most one call ahead of another (finishing a call
needs every rank's data of it), so while a rank reads the buffer of call e, its peers
write either that one or the buffer of call e + 1, and the buffer it clears, call
e - 1's, is one whose words it has already read from every rank and no rank writes
again before call e + 2, which waits for this rank's data of call e + 1. Every GPU must
run the same sequence of calls (as SPMD programs do); a GPU that never arrives leaves
the others waiting, as NCCL's would. A program waits only on its own index on the other
GPUs (add_norm.py's, on the indices of its row, which every call runs together), and at
most `_SLOTS` programs of at most 256 threads run, which any GPU holds resident at once.

The PTX runs as side-effecting inline assembly (Pallas's own `elementwise_inline_asm` is
pure, which lets the compiler drop or move the stores, or hoist the polling loads out
of their loop). The kernel needs peer access between the GPUs (`enable_peer_access`)
and has no interpret mode: it only means something on GPUs;
tests/kernels/test_peer_allreduce.py checks it on them against a float32 `psum`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.triton_util import compiler_params as _compiler_params

CHUNK = 512  # 32-bit words (a float32, or a bfloat16 pair) a program moves per rank
MAX_WORDS = 1 << 16  # the largest tensor, in words (256 KiB): a decode step's activations
_SLOTS = MAX_WORDS // CHUNK  # programs, each with its own call counter


SENTINEL = -(1 << 31)  # int32 0x80000000: a receive buffer's word before its data lands
_BUFFERS = 3


@dataclasses.dataclass(frozen=True)
class Layout:
    """Word offsets in a rank's int32 workspace: counters `[slots]`, then data
    `[3, ranks, MAX_WORDS]` (the sentinel wherever no data is in flight)."""

    ranks: int

    @property
    def data(self) -> int:
        return _SLOTS

    @property
    def words(self) -> int:
        return self.data + _BUFFERS * self.ranks * MAX_WORDS

    def initial(self) -> np.ndarray:
        """A workspace as it must start: counters zero, every data word the sentinel."""
        words = np.full(self.words, SENTINEL, np.int32)
        words[:self.data] = 0
        return words


def words_of(x: jax.ShapeDtypeStruct | jax.Array) -> int:
    """`x`'s size in 32-bit words (bfloat16 in pairs), 0 for a dtype the kernel refuses."""
    if x.dtype == jnp.float32:
        return x.size
    if x.dtype == jnp.bfloat16 and x.size % 2 == 0:
        return x.size // 2
    return 0


def supported(x: jax.ShapeDtypeStruct | jax.Array) -> bool:
    """Whether `x` fits the kernel: float32, or bfloat16 of an even size; at most
    MAX_WORDS words, in whole chunks (or one chunk of a power of two)."""
    words = words_of(x)
    whole = words % CHUNK == 0 if words >= CHUNK else words & (words - 1) == 0
    return 0 < words <= MAX_WORDS and whole


@functools.cache
def _asm_primitive():
    """Side-effecting inline PTX: a primitive of our own whose Triton lowering sets
    pure=False (made on first use: it reaches into JAX's Triton lowering)."""
    from jax._src import core as jax_core
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax._src.pallas.triton import primitives as triton_primitives
    from jax.interpreters import mlir

    prim = jax_core.Primitive("jaxllm_volatile_asm")
    prim.multiple_results = True

    @prim.def_effectful_abstract_eval
    def _abstract(*avals, asm, constraints, result_shape_dtypes):
        del avals, asm, constraints
        return ([jax_core.ShapedArray(s.shape, s.dtype) for s in result_shape_dtypes],
                {triton_primitives.barrier_effect})

    @triton_lowering.register_lowering(prim)
    def _lower(ctx, *args, asm, constraints, result_shape_dtypes):
        del result_shape_dtypes
        (aval,) = ctx.avals_out
        return [tt_dialect.elementwise_inline_asm(
            [mlir.aval_to_ir_type(ctx.context.mlir_ctx, aval)], asm,
            constraints=constraints, pure=False, packed_element=1, args=args)]

    return prim


def _asm(asm: str, constraints: str, *args: jax.Array) -> jax.Array:
    """One int32 result per element of `args` (all one shape), the asm's `$0`."""
    shape = args[0].shape
    return _asm_primitive().bind(
        *args, asm=asm, constraints=constraints,
        result_shape_dtypes=(jax.ShapeDtypeStruct(shape, jnp.int32),))[0]


# $1, $2: an address's low and high words; $3: a byte offset added to it.
_ADDR = "mov.b64 a, {$1, $2}; cvt.u64.u32 o, $3; add.u64 a, a, o;"
_REGS = ".reg .b64 a; .reg .b64 o;"
_LOAD = f"{{ {_REGS} {_ADDR} ld.volatile.global.b32 $0, [a]; }}"
_STORE = f"{{ {_REGS} {_ADDR} st.volatile.global.b32 [a], $4; mov.b32 $0, 0; }}"
_AFTER_PRIOR = "griddepcontrol.wait; mov.b32 $0, $1;"


def sendable(words: jax.Array, pairs: bool) -> jax.Array:
    """int32 `words` (bfloat16 pairs, or float32) with each -0.0 that would make the
    sentinel sent as +0.0: a bfloat16 pair's high half, or a float32."""
    if pairs:
        return jnp.where((words & jnp.int32(-65536)) == SENTINEL, words & 0xFFFF, words)
    return jnp.where(words == SENTINEL, 0, words)


def _f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def rounded(v: jax.Array) -> jax.Array:
    """float32 `v`'s bits rounded to bfloat16's, to nearest even, in the top half."""
    b = lax.bitcast_convert_type(v, jnp.int32)
    return b + 0x7FFF + ((b >> 16) & 1)


def unpack(words: jax.Array, pairs: bool) -> tuple[jax.Array, ...]:
    """int32 `words` as float32 values: a bfloat16 pair's low and high halves, or one
    float32 a word."""
    if pairs:  # a bfloat16 is the top half of its float32
        return _f32(words << 16), _f32(words & jnp.int32(-65536))
    return (_f32(words),)


def pack(halves: tuple[jax.Array, ...], pairs: bool) -> jax.Array:
    """`unpack`'s inverse, bfloat16 rounded to nearest even."""
    if pairs:
        lo, hi = halves
        return (rounded(hi) & jnp.int32(-65536)) | ((rounded(lo) >> 16) & 0xFFFF)
    return lax.bitcast_convert_type(halves[0], jnp.int32)


def exchange(lo_ref, hi_ref, rank_ref, words: jax.Array, *, ranks: int, start: jax.Array,
             clear: int, after_prior: bool, poll: tuple[jax.Array, int] | None = None
             ) -> tuple[tuple[jax.Array, ...], Callable[[], None]]:
    """Steps 1-3 of the module's docstring for this program's `words` `[n]`, which sit
    at word `start` of every rank's buffers (the same `start` in every call of this
    program index; `clear` words from it are cleared of the previous call's). Returns
    every rank's words, in rank order, once all have landed, and the call's end (the
    counter's store), to run after the program's outputs are written.

    `poll` `(start, n)`: wait for, and return, those words of every rank instead of
    this program's own: words other programs send, which must run every call beside
    this one (so that they use the same buffer)."""
    layout = Layout(ranks)
    i = pl.program_id(0)
    rank = rank_ref[0]
    n = words.shape[0]
    poll_start, poll_n = (start, n) if poll is None else poll

    def vec(v, m):
        return jnp.broadcast_to(jnp.asarray(v, jnp.int32), (m,))

    def slot(buffer, src, at, m):  # byte offsets of words at..at+m of `src` in `buffer`
        lane = lax.broadcasted_iota(jnp.int32, (m,), 0)
        return (layout.data + (buffer * ranks + src) * MAX_WORDS + at + lane) * 4

    # Launched as a dependent of the kernel before: wait until it has finished and its
    # writes are visible (that kernel may be this one's previous call, whose counter
    # store the epoch needs).
    if after_prior:
        _asm(_AFTER_PRIOR, "=r,r", vec(rank, 1))
    own_lo, own_hi = lo_ref[rank], hi_ref[rank]
    epoch = jnp.max(_asm(_LOAD, "=r,r,r,r", vec(own_lo, 1), vec(own_hi, 1), vec(i * 4, 1))) + 1
    buffer = epoch % _BUFFERS
    previous = (epoch + _BUFFERS - 1) % _BUFFERS
    for src in range(ranks):
        _asm(_STORE, "=r,r,r,r,r", vec(own_lo, clear), vec(own_hi, clear),
             slot(previous, src, start, clear), vec(SENTINEL, clear))
    for p in range(ranks):
        _asm(_STORE, "=r,r,r,r,r", vec(lo_ref[p], n), vec(hi_ref[p], n),
             slot(buffer, rank, start, n), words)

    def read(_=None):  # every rank's words at once: the loads overlap in flight
        return tuple(_asm(_LOAD, "=r,r,r,r", vec(own_lo, poll_n), vec(own_hi, poll_n),
                          slot(buffer, src, poll_start, poll_n)) for src in range(ranks))

    def landing(received):  # whether any word is still the sentinel
        return sum(jnp.max(jnp.where(w == SENTINEL, 1, 0)) for w in received) > 0

    def finish():
        _asm(_STORE, "=r,r,r,r,r", vec(own_lo, 1), vec(own_hi, 1), vec(i * 4, 1),
             vec(epoch, 1))

    return lax.while_loop(landing, read, read()), finish


def total(received: tuple[jax.Array, ...], pairs: bool) -> tuple[jax.Array, ...]:
    """The ranks' words summed in rank order in float32 (so every GPU gets the same
    bits), as `unpack` lays them out."""
    sums = None
    for w in received:
        parts = unpack(w, pairs)
        sums = parts if sums is None else tuple(a + b for a, b in zip(sums, parts, strict=True))
    return sums


def _kernel(lo_ref, hi_ref, rank_ref, x_ref, o_ref, *, ranks: int, chunk: int,
            pairs: bool, after_prior: bool):
    i = pl.program_id(0)
    at = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
    # A program's words start at i * CHUNK in every call (one program where a call has
    # fewer words), so clearing a whole chunk clears whatever its previous call moved.
    received, finish = exchange(lo_ref, hi_ref, rank_ref, sendable(x_ref[at], pairs),
                                ranks=ranks, start=i * chunk, clear=CHUNK,
                                after_prior=after_prior)
    o_ref[at] = pack(total(received, pairs), pairs)
    finish()


def all_reduce(x: jax.Array, table: jax.Array, axis_name: str, ranks: int) -> jax.Array:
    """The sum of `x` over `axis_name` (inside `shard_map`), in float32 (bfloat16 rounded
    once at the end). `table [2, ranks]` int32: every rank's workspace address (low
    words, high words), from `Workspace.table`."""
    if not supported(x):
        raise ValueError(f"{x.shape} {x.dtype} is not a tensor the peer all-reduce takes")
    pairs = x.dtype == jnp.bfloat16
    flat = lax.bitcast_convert_type(x.reshape(-1, 2) if pairs else x.reshape(-1), jnp.int32)
    words = flat.shape[0]
    chunk = min(CHUNK, words)
    rank = lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    out = pl.pallas_call(
        functools.partial(_kernel, ranks=ranks, chunk=chunk, pairs=pairs,
                          after_prior=dependent_launch()),
        out_shape=jax.ShapeDtypeStruct((words,), jnp.int32),
        grid=(words // chunk,),
        compiler_params=_compiler_params(4, 1), name="peer_all_reduce",
    )(table[0], table[1], rank, flat)
    return lax.bitcast_convert_type(out, x.dtype).reshape(x.shape)


def dependent_launch() -> bool:
    """Whether the GPUs run programmatic dependent launch (Hopper on), whose
    `griddepcontrol` instructions older GPUs do not assemble."""
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    return int(str(cc).split(".")[0]) >= 9


def enable_peer_access(devices) -> None:
    """Lets each of `devices` (CUDA GPUs of this process) read and write the others'
    memory, through the driver API on their primary contexts (XLA's)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    ids = [d.local_hardware_id for d in devices]
    ctxs = {}
    for i in ids:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check(cuda.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
        _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        ctxs[i] = ctx
    prev = ctypes.c_void_p()
    _check(cuda.cuCtxGetCurrent(ctypes.byref(prev)), "cuCtxGetCurrent")
    try:
        for i in ids:
            _check(cuda.cuCtxSetCurrent(ctxs[i]), "cuCtxSetCurrent")
            for j in ids:
                if i != j:
                    # 704: already enabled (XLA or NCCL did it).
                    _check(cuda.cuCtxEnablePeerAccess(ctxs[j], 0), "cuCtxEnablePeerAccess",
                           ok=(0, 704))
    finally:
        cuda.cuCtxSetCurrent(prev)


def _check(code: int, what: str, ok=(0,)) -> None:
    if code not in ok:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


class Workspace:
    """One int32 workspace a GPU of `mesh`'s `axis` (laid out and started as `Layout`
    says), allocated once and kept for the life of the programs that use it, and the
    address table they take."""

    def __init__(self, mesh, axis: str):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.ranks = mesh.shape[axis]
        layout = Layout(self.ranks)
        devices = list(np.asarray(mesh.devices).reshape(-1))
        enable_peer_access(devices)
        self.buffers = jax.device_put(np.tile(layout.initial(), (self.ranks, 1)),
                                      NamedSharding(mesh, P(axis)))
        jax.block_until_ready(self.buffers)
        shards = sorted(self.buffers.addressable_shards, key=lambda s: s.index[0].start or 0)
        addrs = np.array([s.data.unsafe_buffer_pointer() for s in shards], np.uint64)
        lo = (addrs & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
        hi = (addrs >> np.uint64(32)).astype(np.uint32).view(np.int32)
        self.table = jax.device_put(np.stack([lo, hi]), NamedSharding(mesh, P()))
