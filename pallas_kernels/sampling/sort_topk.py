"""Top-k / top-p by a full sort, in plain jnp: the oracle for `topk_topp.py`.

Semantics (vLLM v1's `apply_top_k_top_p`), per row of `logits [R, V]`:

* top-k: `top_k[r]` in `(0, V)` keeps every token whose logit is at least the
  k-th largest logit, so tokens tied with the k-th are all kept (as in vLLM,
  which compares against the k-th value). `0` or `>= V` turns it off.
* top-p: computed on the distribution left after top-k (softmax over the kept
  tokens). In descending order, a token is kept while the probability mass of
  the tokens before it is `< top_p`; so the most likely token is always kept
  and the kept set is the smallest prefix whose mass reaches `top_p`. This is
  vLLM's "ascending cumsum <= 1 - p is removed" rule written the other way.
  `top_p >= 1` turns it off. Tokens tied in logit are ordered by a stable sort
  (lower token id first), so a tie that straddles the cut keeps only part of
  the tied group here; the threshold search keeps the whole group.

Masked tokens come back as `-inf`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep mask `[R, V]` bool for per-row `top_k [R]` int and `top_p [R]` float."""
    num_rows, vocab = logits.shape
    logits = logits.astype(jnp.float32)
    order = jnp.argsort(-logits, axis=-1, stable=True)  # descending, ties by token id
    srt = jnp.take_along_axis(logits, order, axis=-1)
    k_on = (top_k > 0) & (top_k < vocab)
    kth = jnp.take_along_axis(srt, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    keep_k_sorted = jnp.where(k_on[:, None], srt >= kth, True)
    srt = jnp.where(keep_k_sorted, srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    # Exclusive cumsum: the mass strictly before each position.
    cum = jnp.cumsum(probs, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
    keep_p_sorted = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_sorted = keep_k_sorted & keep_p_sorted
    rows = jnp.arange(num_rows)[:, None]
    return jnp.zeros((num_rows, vocab), bool).at[rows, order].set(keep_sorted)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`logits` with the tokens outside top-k / top-p set to `-inf`."""
    return jnp.where(top_k_top_p_mask(logits, top_k, top_p), logits, -jnp.inf)


def top_k_largest(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries per row, descending, ties by lower index first."""
    return jax.lax.top_k(x, k)
