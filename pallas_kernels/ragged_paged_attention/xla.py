"""Ragged paged attention in plain jnp (XLA): the body the CPU runs, and the
oracle for the Pallas TPU and GPU bodies.

Semantics (shared/DESIGN.md, "Kernels"):

* `q` holds the queries of every scheduled token, flattened over the batch:
  `[num_tokens, num_q_heads, head_dim]`. Request r owns rows
  `cu_q_lens[r] : cu_q_lens[r + 1]`; only the first `num_seqs[0]` requests are
  real, and rows past `cu_q_lens[num_seqs]` are padding (their output is 0).
* `kv_cache` is paged: `[num_pages, page_size, 2 * num_kv_heads, head_dim]`,
  K and V interleaved along the head axis (K of kv head h at 2h, V at 2h + 1),
  so one page holds both K and V of `page_size` positions.
* `page_indices[r]` is request r's block table; `kv_lens[r]` is its context
  length including this step's new tokens (already written to the cache).
* `page_offset` (static, default 0) is added to every page index: the caches
  of all layers can live in one array, layer l's pages at `l * P + page`, so a
  step passes the device one cache instead of one per layer.
* Causal by absolute position: query j of request r sits at
  `kv_lens[r] - q_len[r] + j` and sees keys at positions <= its own, and, with
  a sliding window W, only keys at positions > its own - W.
* Optional logit soft-cap: `s = cap * tanh(s / cap)` before the softmax.
* Optional attention sinks (GPT-OSS): one learned logit per query head, `sinks
  [num_q_heads]`, joins each row's softmax as a key that carries no value, so the
  row's weights sum to less than one.
* GQA: query head h reads kv head `h // (num_q_heads // num_kv_heads)`.

The softmax runs in float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    return (num_pages, page_size, 2 * num_kv_heads, head_dim)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, page_offset: int = 0) -> jax.Array:
    """Writes new K/V rows (`[num_tokens, num_kv_heads, head_dim]`) to their slots.

    `slot_mapping[t] = page * page_size + offset`, `page` counted from
    `page_offset`. Padding tokens point at a scratch slot (page 0 is reserved
    for that), so they never touch live KV.
    Under donation this scatter updates the cache in place.
    """
    num_pages, page_size, two_h, head_dim = kv_cache.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], two_h, head_dim)
    flat = kv_cache.reshape(num_pages * page_size, two_h, head_dim)
    slots = slot_mapping + page_offset * page_size
    flat = flat.at[slots].set(kv.astype(kv_cache.dtype), mode="drop", unique_indices=False)
    return flat.reshape(kv_cache.shape)


def token_positions(kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                    num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: (request index, absolute position, is-real-token)."""
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    n = jnp.reshape(num_seqs, (-1,))[0]
    req = jnp.searchsorted(cu_q_lens[1:], tok, side="right").astype(jnp.int32)
    req = jnp.minimum(req, kv_lens.shape[0] - 1)
    valid = tok < cu_q_lens[n]
    q_len = cu_q_lens[req + 1] - cu_q_lens[req]
    pos = kv_lens[req] - q_len + (tok - cu_q_lens[req])
    return req, pos, valid


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    page_offset: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, two_h, _ = kv_cache.shape
    num_kv_heads = two_h // 2
    group = num_q_heads // num_kv_heads
    max_len = page_indices.shape[1] * page_size

    req, pos, valid = token_positions(kv_lens, cu_q_lens, num_seqs, num_tokens)
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    key_pos = jnp.arange(max_len, dtype=jnp.int32)
    n = jnp.reshape(num_seqs, (-1,))[0]
    sink = (None if sinks is None else
            sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1))

    def one_request(r, out):
        kv = kv_cache[page_indices[r] + page_offset].reshape(max_len, two_h, head_dim)
        kv = kv.astype(jnp.float32)
        k, v = kv[:, 0::2], kv[:, 1::2]  # [L, Hkv, D]
        s = jnp.einsum("tkgd,lkd->tkgl", qf, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < kv_lens[r])
        if sliding_window is not None:
            mask &= key_pos[None, :] > pos[:, None] - sliding_window
        mask &= ((req == r) & valid)[:, None]
        s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
        m = s.max(axis=-1, keepdims=True)
        if sink is not None:
            m = jnp.maximum(m, sink)
        p = jnp.exp(s - m)
        p = jnp.where(mask[:, None, None, :], p, 0.0)
        denom = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            denom = denom + jnp.exp(sink - m)
        denom = jnp.maximum(denom, 1e-30)
        o = jnp.einsum("tkgl,lkd->tkgd", p / denom, v)
        return out + o

    out = jax.lax.fori_loop(0, n, one_request,
                            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
