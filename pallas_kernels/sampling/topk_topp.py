"""Top-k / top-p without sorting the vocabulary: a radix threshold search.

Both filters keep the tokens whose logit is at least a per-row threshold, so
the work is finding the threshold. Floats are mapped to uint32 keys that order
as the floats do (`sortable_key`), and each row's threshold key is built from
its top bit down: a round fixes `bits_per_round` bits by testing the
`2**bits - 1` candidate keys at once, in one pass over the logits. After 32
bits the threshold is exact (always the key of some token), so, per row:

* top-k: the largest key t with `count(key >= t) >= k` is exactly the k-th
  largest logit. Same kept set as the sort reference, ties included (both keep
  every token tied with the k-th).
* top-p, on the distribution left after top-k: with `e = exp(l - max)` over
  the top-k set and `Z = sum(e)`, the largest t with
  `F(t) = sum(e[key >= t]) >= top_p * Z`. A token is kept iff its key is
  `>= t`, which is the reference's rule "mass strictly before it `< top_p`".

Where it may differ from `sort_topk.py` (document, do not "fix"):

* Ties at the top-p cut: the whole tied group is kept; the reference, which
  orders ties by token id, may keep only part of it.
* Rounding: masses are summed in a different order than the reference's
  cumsum, so a token whose mass-before lies within float32 rounding (about
  1e-6 relative) of `top_p` can fall on the other side.

Cost: `2 * 32 / bits_per_round` passes over `[R, V]`, each with
`2**bits - 1` compares per element, plus a few passes for max and sums. All
shapes are fixed; the rounds are unrolled (no device loop, no host sync).
There is no Pallas body yet: XLA fuses each round into one reduction, and
that already beats the sort on an H100 (numbers at DEFAULT_BITS_PER_ROUND).

Denormal logits: XLA flushes them to zero, so they key (and tie) as 0.0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The fastest setting in scripts/bench_sampling.py on the H100, and the only one
# that beats the sort (BENCHMARKS.md, kernels). The rounds are compute-bound,
# not bandwidth-bound, so a Pallas body that keeps a row on chip is the next step.
DEFAULT_BITS_PER_ROUND = 4
TOP_K_BLOCK = 128


def sortable_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with `a < b  <=>  key(a) < key(b)` (-0.0 maps to +0.0's key)."""
    x = jnp.where(x == 0, jnp.float32(0), x.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _radix_search(count_ok, num_rows: int, bits: int) -> jax.Array:
    """Largest uint32 t per row with `ok(t)`, for an `ok` that is true at 0 and monotone.

    `count_ok(cands [R, C] uint32) -> [R, C] bool`.
    """
    if 32 % bits:
        raise ValueError(f"bits_per_round must divide 32, got {bits}")
    ans = jnp.zeros((num_rows,), jnp.uint32)
    digits = jnp.arange(1, 2**bits, dtype=jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        cands = ans[:, None] | (digits << shift)[None, :]
        # ok is monotone in the candidate, so the count of true ones is the digit.
        digit = jnp.sum(count_ok(cands), axis=-1, dtype=jnp.uint32)
        ans = ans | (digit << shift)
    return ans


def top_k_top_p_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                          bits_per_round: int = DEFAULT_BITS_PER_ROUND) -> jax.Array:
    """Per-row threshold key `[R]` uint32: keep token v iff `sortable_key(l_v) >= t`."""
    num_rows, vocab = logits.shape
    logits = logits.astype(jnp.float32)
    key = sortable_key(logits)

    def at_least_k(cands: jax.Array) -> jax.Array:
        counts = jnp.sum(key[:, None, :] >= cands[:, :, None], axis=-1, dtype=jnp.int32)
        return counts >= top_k[:, None]

    k_on = (top_k > 0) & (top_k < vocab)
    t_k = jnp.where(k_on, _radix_search(at_least_k, num_rows, bits_per_round), 0)

    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(key >= t_k[:, None], jnp.exp(logits - row_max), 0.0)
    target = top_p * jnp.sum(e, axis=-1)

    def mass_reaches_p(cands: jax.Array) -> jax.Array:
        mass = jnp.sum(jnp.where(key[:, None, :] >= cands[:, :, None], e[:, None, :], 0.0),
                       axis=-1)
        return mass >= target[:, None]

    p_on = top_p < 1.0
    t_p = jnp.where(p_on, _radix_search(mass_reaches_p, num_rows, bits_per_round), 0)
    return jnp.maximum(t_k, t_p)


def top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                     bits_per_round: int = DEFAULT_BITS_PER_ROUND) -> jax.Array:
    """Keep mask `[R, V]` bool; same contract as `reference.top_k_top_p_mask`."""
    t = top_k_top_p_threshold(logits, top_k, top_p, bits_per_round=bits_per_round)
    return sortable_key(logits) >= t[:, None]


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                      bits_per_round: int = DEFAULT_BITS_PER_ROUND) -> jax.Array:
    """`logits` with the tokens outside top-k / top-p set to `-inf`."""
    keep = top_k_top_p_mask(logits, top_k, top_p, bits_per_round=bits_per_round)
    return jnp.where(keep, logits, -jnp.inf)


def top_k_largest(x: jax.Array, k: int, *,
                  block: int = TOP_K_BLOCK) -> tuple[jax.Array, jax.Array]:
    """The k largest entries per row of `[R, V]` (descending), without a full sort.

    The k largest entries lie in the k blocks with the largest block maxima
    (ranked by max, then lower block first): a block outside those has k
    blocks ahead of it, each holding an entry that beats all of its own. So
    `lax.top_k` runs on k blocks' entries instead of V. The candidate blocks
    are put back in index order, so ties break by lower index exactly as in
    `lax.top_k` over the whole row (the oracle).
    """
    num_rows, vocab = x.shape
    num_blocks = -(-vocab // block)
    if num_blocks <= 2 * k:
        return jax.lax.top_k(x, k)
    if num_blocks * block != vocab:
        x = jnp.pad(x, ((0, 0), (0, num_blocks * block - vocab)), constant_values=-jnp.inf)
    blocks = x.reshape(num_rows, num_blocks, block)
    _, block_ids = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    block_ids = jnp.sort(block_ids, axis=-1)
    cands = jnp.take_along_axis(blocks, block_ids[:, :, None], axis=1)
    values, pos = jax.lax.top_k(cands.reshape(num_rows, k * block), k)
    chosen_block = jnp.take_along_axis(block_ids, pos // block, axis=-1)
    return values, chosen_block * block + pos % block
