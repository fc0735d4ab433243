"""The on-device sampler: logits of the scheduled requests -> next tokens (+ logprobs).

Order, as vLLM v1 (`Sampler.forward`):

1. Logprobs, when asked, are of the raw model output (vLLM's default
   `logprobs_mode="raw_logprobs"`): log_softmax before any processing.
2. The logits processors (logits_processors.py: logit_bias, allowed tokens,
   min_tokens, bad words, then the penalties: repetition, then frequency and
   presence), then the structured-output `token_bitmask` sets disallowed tokens
   to -inf.
3. Greedy rows take the arg-max of those logits.
4. Other rows: divide by temperature; min-p (relative to the most likely
   token; vLLM v1 applies it before top-k/top-p, and it commutes with top-k);
   top-k; top-p on what is left; then Gumbel-max with the row's key, which
   draws exactly from the softmax of the kept logits.

Everything is fixed-shape and jittable; `SamplingMetadata`'s structure picks
the compiled variant (see metadata.py).

Tensor parallelism: the logits arrive split over the vocabulary on the mesh
axis 'model', and every step here reduces over the vocabulary with [R]-sized
(or [R, small]) collectives, never gathering `[R, V]`. Where a mesh has more
than one 'model' device, top-k/top-p always takes the threshold search (its
per-round counts and masses are per-shard sums, all-reduced as `[R, 15]`; a
sort would gather whole rows), as vLLM's TPU sampler does, and the top
logprobs are taken per shard, then among the shards' winners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.sample.logits_processors import apply_group
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.output_state import unpack_bits
from jaxllm.sample.rng import rng_keys
from pallas_kernels.sampling import sort_topk, topk_topp

# Top-k/top-p: "threshold" (a sort-free radix search, 4 bits a round) or "sort"
# (sort_topk.py). "auto" takes the search on accelerators, where it is the faster
# (scripts/bench_sampling.py; figures in BENCHMARKS.md), and the sort on the CPU
# (tests, development), where it compiles several times faster and speed does not matter.
# Over a vocabulary split on a 'model' mesh axis the search is taken whatever this says.
TOP_K_TOP_P_IMPL = "auto"
# Top-20 logprobs: "blocks" (topk_topp.top_k_largest) or "lax" (lax.top_k, which XLA
# lowers to a full sort for k = 20); "auto" as above.
TOP_LOGPROBS_IMPL = "auto"


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def vocab_shards(logits: jax.Array) -> int:
    """How many 'model' devices the (traced) logits' vocabulary may be split over:
    the size of that axis on the mesh they were computed on, else 1."""
    mesh = getattr(jax.typeof(logits).sharding, "mesh", None)
    shape = dict(getattr(mesh, "shape", {}) or {})
    return int(shape.get("model", 1))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [R] i32
    # When num_logprobs = K > 0; column 0 is the sampled token, then the top-K.
    logprob_token_ids: jax.Array | None = None  # [R, K + 1] i32
    logprobs: jax.Array | None = None  # [R, K + 1] f32
    ranks: jax.Array | None = None  # [R] i32, rank of the sampled token (1 = best)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Masks tokens with `p < min_p * p_max` (in log space: `l < l_max + log(min_p)`)."""
    cut = jnp.max(logits, axis=-1) + jnp.log(min_p)  # -inf when min_p = 0
    return jnp.where(logits >= cut[:, None], logits, -jnp.inf)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p; over a split vocabulary always the threshold search (a sort
    would gather the rows), so a tp>1 engine on the CPU takes it too."""
    sort = TOP_K_TOP_P_IMPL == "sort" or (TOP_K_TOP_P_IMPL == "auto" and _on_cpu())
    if sort and vocab_shards(logits) == 1:
        return sort_topk.apply_top_k_top_p(logits, top_k, top_p)
    return topk_topp.apply_top_k_top_p(logits, top_k, top_p)


def gumbel_noise(key_data: jax.Array, vocab_size: int) -> jax.Array:
    """`[R, V]` Gumbel(0, 1) noise, row r a pure function of `key_data[r]`."""
    keys = jax.random.wrap_key_data(jnp.asarray(key_data, jnp.uint32), impl="threefry2x32")
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab_size,), jnp.float32))(keys)


def _top_largest_sharded(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over a vocabulary split on 'model': each device's top k of
    its own slice (under `shard_map`: XLA would gather the rows for a top-k), then
    the top k of those `[R, shards * k]`, so only the winners cross devices.
    Candidates stay in index order, so ties break by lower index as in `lax.top_k`
    over the whole row."""
    mesh = jax.typeof(x).sharding.mesh

    def local(part: jax.Array) -> tuple[jax.Array, jax.Array]:
        values, pos = jax.lax.top_k(part, k)
        return values, pos + jax.lax.axis_index("model") * part.shape[-1]

    spec = P(None, "model")
    values, ids = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=(spec, spec))(x)
    values, best = jax.lax.top_k(values, k)
    return values, jnp.take_along_axis(ids, best, axis=-1)


def _top_largest(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    shards = vocab_shards(x)
    if shards > 1 and x.shape[-1] % shards == 0 and x.shape[-1] // shards >= k:
        return _top_largest_sharded(x, k)
    if TOP_LOGPROBS_IMPL == "lax" or (TOP_LOGPROBS_IMPL == "auto" and _on_cpu()):
        return jax.lax.top_k(x, k)
    return topk_topp.top_k_largest(x, k)


def gather_logprobs(logprobs: jax.Array, token_ids: jax.Array,
                    k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chosen token + top-k: ids `[N, k+1]`, logprobs `[N, k+1]`, ranks `[N]`.

    The rank counts the tokens at least as likely as the chosen one (vLLM's
    rule), so it is 1 for the best token when nothing ties with it.
    """
    token_ids = token_ids.astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    ranks = jnp.sum(logprobs >= chosen, axis=-1, dtype=jnp.int32)
    if k == 0:
        return token_ids[:, None], chosen, ranks
    top_lp, top_ids = _top_largest(logprobs, k)
    ids = jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return ids, jnp.concatenate([chosen, top_lp], axis=-1), ranks


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where the packed `bitmask [R, ceil(V / 32)]` has a 0 bit (bit j of word i
    is token 32 i + j), unpacked on the device."""
    return jnp.where(unpack_bits(bitmask, logits.shape[-1]), logits, -jnp.inf)


def adjust_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Step 2: the logits processors' groups, then the token bitmask; what greedy rows
    take the arg-max of."""
    logits = logits.astype(jnp.float32)
    out_index = jnp.asarray(md.out_index)
    if md.fixed is not None:
        logits = apply_group(logits, "fixed", md.fixed, out_index, None)
    if md.history is not None:
        h = md.history
        logits = apply_group(logits, "history", h.args, out_index,
                             (jnp.asarray(h.rows), h.tables))
    if md.token_bitmask is not None:
        logits = apply_token_bitmask(logits, md.token_bitmask)
    return logits


def filter_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Step 4 before the draw: temperature, min-p, top-k, top-p (dropped tokens -inf)."""
    scaled = logits / jnp.asarray(md.temperature, jnp.float32)[:, None]
    scaled = apply_min_p(scaled, jnp.asarray(md.min_p, jnp.float32))
    if md.use_top_k_top_p:
        scaled = apply_top_k_top_p(scaled, jnp.asarray(md.top_k, jnp.int32),
                                   jnp.asarray(md.top_p, jnp.float32))
    return scaled


def draw(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Step 3-4 on already adjusted logits: arg-max for greedy rows, a draw for others."""
    token_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if md.all_greedy:
        return token_ids
    noise = gumbel_noise(rng_keys(md.key_base, md.out_index), logits.shape[-1])
    drawn = jnp.argmax(filter_logits(logits, md) + noise, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.asarray(md.greedy), token_ids, drawn)


def sampled_logprobs(logits: jax.Array, token_ids: jax.Array,
                     k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Step 1, after the draw: logprobs of the raw logits for the chosen token + top-k."""
    return gather_logprobs(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),
                           token_ids, k)


def sample(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
    """Samples one token per row of `logits [R, V]`.

    The model runner runs the three stages (`adjust_logits`, `draw`,
    `sampled_logprobs`) jitted apart (staged.py), so that compiled variants
    add up instead of multiplying; this composition is the same computation
    in one piece, the reference the tests hold the runner's path to.
    """
    logits = logits.astype(jnp.float32)
    token_ids = draw(adjust_logits(logits, md), md)
    if not md.num_logprobs:
        return SamplerOutput(token_ids)
    ids, lps, ranks = sampled_logprobs(logits, token_ids, md.num_logprobs)
    return SamplerOutput(token_ids, ids, lps, ranks)


def compute_prompt_logprobs(logits: jax.Array, target_ids: jax.Array,
                            k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs: position t scores `target_ids[t]` under `logits[t]` (raw).

    Returns ids `[T, k+1]` (target first, then the top-k), logprobs
    `[T, k+1]` and the target's rank `[T]`. `k` must be static under jit.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return gather_logprobs(logprobs, target_ids, k)


def compute_prompt_logprobs_chunked(logits_fn: Callable[[jax.Array], jax.Array],
                                    hidden: jax.Array, target_ids: jax.Array, k: int,
                                    rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`compute_prompt_logprobs(logits_fn(hidden), target_ids, k)`, `rows` positions at a time.

    The `[T, vocab]` logits and their float32 log-softmax are the largest
    temporaries of a step: 8 GB each for 16384 positions of a 128K vocabulary.
    Scored in chunks (a loop on the device), they stay `[rows, vocab]`
    whatever T is. Each position's result depends on its own row only, so
    the chunks (the last one padded) give the same values as one pass.
    """
    t = hidden.shape[0]
    if t <= rows:
        return compute_prompt_logprobs(logits_fn(hidden), target_ids, k)
    n = -(-t // rows)
    pad = n * rows - t
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n, rows, hidden.shape[1])
    targets = jnp.pad(target_ids, (0, pad)).reshape(n, rows)
    ids, lps, ranks = jax.lax.map(
        lambda chunk: compute_prompt_logprobs(logits_fn(chunk[0]), chunk[1], k),
        (hidden, targets))
    return (ids.reshape(n * rows, -1)[:t], lps.reshape(n * rows, -1)[:t],
            ranks.reshape(n * rows)[:t])
