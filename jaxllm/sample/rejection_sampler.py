"""Speculative sampling: verify each request's draft tokens against the target model.

Request r proposes `num_drafts[r] <= K` draft tokens; the target's logits at
its last `K + 1` scheduled positions score them (position j predicts the
token after draft j - 1; position 0 follows the last accepted token). Greedy
rows accept while the draft equals the arg-max and then emit the arg-max.
Other rows run standard speculative sampling, which keeps the target
distribution exactly: draft x at position j is accepted with probability
min(1, p_j(x) / q_j(x)), where p_j is the target's filtered distribution
(temperature, min-p, top-k, top-p, as the sampler draws from) and q_j the
draft's (one-hot for ngram drafts: q(x) = 1); the first rejected position
emits a draw from norm(max(0, p_j - q_j)); if every draft is accepted the
bonus position emits a draw from p.

Randomness follows sample/rng.py: position j of a request samples output
index `out_index + j`, whose key makes both the Gumbel noise of its draw and
(folded with a tag) its acceptance uniform. So a request's tokens depend on
its seed and output index only, and a request with no draft draws exactly
what the plain sampler draws.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.rng import rng_keys
from jaxllm.sample.sampler import filter_logits, gumbel_noise

_UNIFORM_TAG = 0x5EED


def _uniforms(key_data: jax.Array) -> jax.Array:
    """One U[0, 1) per row, from a key independent of the row's Gumbel noise."""
    keys = jax.random.wrap_key_data(jnp.asarray(key_data, jnp.uint32), impl="threefry2x32")
    return jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _UNIFORM_TAG)))(keys)


def expand_metadata(md: SamplingMetadata, k1: int) -> SamplingMetadata:
    """The metadata of `R` requests as `R * k1` rows: row `r * k1 + j` is request r's
    position j, sampling output index `out_index[r] + j`."""
    r = md.temperature.shape[0]

    def rep(a: jax.Array) -> jax.Array:
        return jnp.repeat(jnp.asarray(a)[:r], k1, axis=0)

    index = (jnp.asarray(md.out_index)[:r, None] + jnp.arange(k1, dtype=jnp.int32)).reshape(-1)
    return SamplingMetadata(rep(md.temperature), rep(md.top_k), rep(md.top_p), rep(md.min_p),
                            rep(md.greedy), rep(md.key_base), index,
                            all_greedy=md.all_greedy, use_top_k_top_p=md.use_top_k_top_p)


def rejection_sample(logits: jax.Array, draft_ids: jax.Array, num_drafts: jax.Array,
                     md: SamplingMetadata,
                     draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Tokens emitted per request.

    `logits` `[R * (K + 1), V]` raw target logits, row `r * (K + 1) + j` for
    request r's position j; `draft_ids` `[R, K]`; `num_drafts` `[R]` (padding
    requests 0); `md` the requests' metadata (R rows, `out_index` the output
    index of position 0); `draft_probs` `[R, K, V]` the draft's filtered
    distribution, None for one-hot (ngram) drafts. Returns `tokens` `[R, K + 1]`
    (the accepted drafts, then the corrected or bonus token, then -1) and
    `num_emitted` `[R]` (accepted + 1).
    """
    r, k = draft_ids.shape
    k1 = k + 1
    v = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    draft_ids = draft_ids.astype(jnp.int32)
    pos = jnp.arange(k1, dtype=jnp.int32)
    valid = pos[None, :k] < num_drafts[:, None]
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(r, k1)
    greedy_accept = draft_ids == argmax[:, :k]
    if md.all_greedy:
        accept, rejected_token, bonus = greedy_accept, argmax[:, :k], argmax
    else:
        mdx = expand_metadata(md, k1)
        keys = rng_keys(mdx.key_base, mdx.out_index)
        noise = gumbel_noise(keys, v)
        filtered = filter_logits(logits, mdx)
        drawn = jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32).reshape(r, k1)
        filtered = filtered.reshape(r, k1, v)[:, :k]
        logp = jax.nn.log_softmax(filtered, axis=-1)
        p_x = jnp.exp(jnp.take_along_axis(logp, draft_ids[..., None], axis=-1)[..., 0])
        onehot = jax.nn.one_hot(draft_ids, v, dtype=bool)
        if draft_probs is None:  # q is one-hot at the draft: q(x) = 1
            q_x = jnp.ones_like(p_x)
            residual = jnp.where(onehot, -jnp.inf, filtered)
        else:
            q = draft_probs.astype(jnp.float32)
            q_x = jnp.take_along_axis(q, draft_ids[..., None], axis=-1)[..., 0]
            residual = jnp.log(jnp.maximum(jnp.exp(logp) - q, 0.0))
        u = _uniforms(keys).reshape(r, k1)[:, :k]
        random_accept = u * q_x < p_x  # u < p(x) / q(x), without dividing by zero
        noise_k = noise.reshape(r, k1, v)[:, :k]
        resampled = jnp.argmax(residual + noise_k, axis=-1).astype(jnp.int32)
        # No mass left outside the draft (p == q): the draft is the only outcome.
        empty = jnp.all(residual == -jnp.inf, axis=-1)
        random_accept = random_accept | empty
        greedy = jnp.asarray(md.greedy)[:r, None]
        accept = jnp.where(greedy, greedy_accept, random_accept)
        rejected_token = jnp.where(greedy, argmax[:, :k], resampled)
        bonus = jnp.where(greedy, argmax, drawn)
    accepted = jnp.sum(jnp.cumprod(accept & valid, axis=1), axis=1).astype(jnp.int32)
    last = jnp.where(accepted < num_drafts,
                     jnp.take_along_axis(jnp.pad(rejected_token, ((0, 0), (0, 1))),
                                         accepted[:, None], axis=1)[:, 0],
                     jnp.take_along_axis(bonus, accepted[:, None], axis=1)[:, 0])
    drafts = jnp.pad(draft_ids, ((0, 0), (0, 1)))
    tokens = jnp.where(pos < accepted[:, None], drafts,
                       jnp.where(pos == accepted[:, None], last[:, None], -1))
    return tokens, accepted + 1
