"""The EAGLE / EAGLE-3 proposer: a one-layer head (models/eagle.py) over the target's hidden
states, run as the draft model is (draft_model.py): its own paged KV cache on the
target's block ids, a mirror of every target forward (`follow`) and k greedy steps at
a verify step's dispatch (`propose`).

The head at position p reads token p + 1 with the target's hidden state at p (vLLM's
alignment), so a forward's last row per request has no token yet when the forward
runs. The follow therefore writes the head's KV for each step's rows with their
successors' tokens (the last row's is rewritten later), keeps the target's hidden
states by KV slot in a cache of its own (`[num_blocks * block_size, H]`; EAGLE-3's
after `fc`), and first rewrites each request's position c - 1 (c: its computed
tokens before the step) from that cache and its now known token c. A proposal
starts at the same position c - 1, from token c and the cached hidden state, and
each step feeds the head's own hidden output to the next. Prefix-cache hits give
up their last block with an EAGLE head (the scheduler's KV cache manager, as
vLLM), so a rewritten position c - 1 in a shared block gets the value it held.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import EngineConfig
from jaxllm.errors import ParameterError
from jaxllm.kv_groups import KVCacheGroups
from jaxllm.models.eagle import load_eagle_head
from jaxllm.models.llama import llama_arch
from jaxllm.models.loader import kv_cache_spec
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.draft_model import DraftModel, propose_buckets
from jaxllm.worker.kv_cache import PagedKVCache
from jaxllm.worker.step_inputs import unpack_step_inputs


@functools.cache
def eagle_functions(graphdef: Any, state_def: Any, head_logits: Any, num_reqs: int,
                    width: int, k: int, block_size: int, max_len: int,
                    replicated: NamedSharding) -> tuple[Any, Any]:
    """The jitted `follow` and `propose` of one head graph. The weights are the head's
    leaves, then the embedding and the target's logits head it reads. The target's
    captured states, the hidden-state cache and what is read of it are `[tokens, H]`
    rows every device holds whole (`replicated`), as the residual stream is: pinned,
    so that no program gathers or reshards them."""

    def pin(x):
        return jax.lax.with_sharding_constraint(x, replicated)

    def merge(weights):
        head = nnx.merge(graphdef, jax.tree.unflatten(state_def, weights[:-2]))
        return head, weights[-2], weights[-1]

    def slot_of(pages, pos):
        return pages[jnp.arange(pages.shape[0]), pos // block_size] * block_size + \
            pos % block_size

    def follow(weights, kv_cache, hidden_cache, packed, drafts, captured):
        input_ids, positions, md, src, _ = unpack_step_inputs(packed, num_reqs, width)
        input_ids = jnp.where(src >= 0, drafts.reshape(-1)[jnp.maximum(src, 0)], input_ids)
        head, embed, _ = merge(weights)
        hidden = pin(head.combine(pin(captured)).astype(hidden_cache.dtype))
        t, n = input_ids.shape[0], md.num_seqs[0]
        first = jnp.minimum(md.cu_q_lens[:-1], t - 1)
        live = jnp.arange(num_reqs) < n
        c = positions[first]
        prev = jnp.maximum(c - 1, 0)
        slot = jnp.where(live & (c >= 1), slot_of(md.page_indices, prev), 0)
        # Each request's position c - 1 again, now that token c is known (c = 0: none).
        fix_md = dataclasses.replace(
            md, slot_mapping=slot.astype(jnp.int32),
            kv_lens=jnp.where(live, jnp.maximum(c, 1), 0).astype(jnp.int32),
            cu_q_lens=jnp.minimum(jnp.arange(num_reqs + 1), n).astype(jnp.int32))
        _, _, kv_cache = head(jnp.take(embed, input_ids[first], axis=0),
                              pin(hidden_cache[slot]), prev, kv_cache, fix_md)
        # Every row with its successor's token (a request's last row: rewritten later).
        nxt = input_ids[jnp.minimum(jnp.arange(t) + 1, t - 1)]
        _, _, kv_cache = head(jnp.take(embed, nxt, axis=0), hidden, positions, kv_cache, md)
        return kv_cache, pin(hidden_cache.at[md.slot_mapping].set(hidden))

    def propose(weights, kv_cache, hidden_cache, packed):
        """`[num_reqs, k]` greedy drafts from each request's token c at position c - 1
        (packed as the draft model's `propose` packs them); steps past a request's
        draft count write no KV."""
        input_ids, positions, md, _, num_drafts = unpack_step_inputs(packed, num_reqs, width)
        head, embed, lm = merge(weights)
        t, n = input_ids.shape[0], md.num_seqs[0]
        tok = jnp.arange(t)
        req = jnp.minimum(tok, num_reqs - 1)
        live = tok < n
        counts = jnp.where(live, num_drafts[req], 0)
        pages = md.page_indices[req]
        req_pos = positions[jnp.minimum(jnp.arange(num_reqs), t - 1)]
        live_req = jnp.arange(num_reqs) < n

        def at(s):
            pos = positions - 1 + s
            ok = live & (pos >= 0) & (s <= counts)
            pos = jnp.clip(pos, 0, max_len - 1)
            return pos, jnp.where(ok, slot_of(pages, pos), 0).astype(jnp.int32)

        def step(s, carry):
            kv_cache, tokens, hidden, drafts = carry
            pos, slot = at(s)
            step_md = dataclasses.replace(
                md, slot_mapping=slot,
                kv_lens=jnp.where(live_req, jnp.clip(req_pos - 1 + s, 0, max_len - 1) + 1,
                                  0).astype(jnp.int32))
            out, logit_hidden, kv_cache = head(jnp.take(embed, tokens, axis=0), hidden, pos,
                                               kv_cache, step_md)
            nxt = head.greedy(logit_hidden, lm, head_logits)
            return kv_cache, nxt, pin(out.astype(hidden.dtype)), drafts.at[:, s].set(nxt)

        _, first_slot = at(0)
        hidden = pin(hidden_cache[jnp.where(positions >= 1, first_slot, 0)])
        kv_cache, _, _, drafts = jax.lax.fori_loop(
            0, k, step, (kv_cache, input_ids, hidden, jnp.zeros((t, k), jnp.int32)))
        drafts = drafts[:num_reqs] if t >= num_reqs else jnp.pad(
            drafts, ((0, num_reqs - t), (0, 0)))
        return kv_cache, drafts

    return (jax.jit(follow, donate_argnums=(1, 2)), jax.jit(propose, donate_argnums=(1,)))


class EagleDrafter(DraftModel):
    """An EAGLE head's weights, KV and hidden-state caches and programs beside one runner."""

    def __init__(self, config: EngineConfig, mesh: Any, attn_backend: Any, swiglu: Any,
                 buckets: Buckets, target: Any):
        spec, mc = config.eagle_head, config.model_config
        self.buckets = buckets
        self.num_groups = 1  # the target's KV cache groups (several are refused)
        self.k = config.speculative_config.num_speculative_tokens
        self.mesh = mesh
        head = load_eagle_head(spec, mesh, attn_backend, swiglu, mc.dtype)
        graphdef, state = nnx.split(head)
        embed = head.embed_tokens if spec.own_embed else target.embed_tokens
        self.state = [*jax.tree.leaves(state), embed[...], target.logits_head[...]]
        arch = llama_arch(spec.hf_config)
        self.dtype = jnp.dtype(mc.dtype)
        self.hidden_size = arch.hidden_size
        self.captured_width = spec.fc_in if spec.eagle3 else arch.hidden_size
        self.block_size = config.cache_config.block_size
        # Split on kv heads as the target's cache (copies where fewer than devices).
        kv_heads = kv_cache_spec(spec.hf_config, mesh.shape["model"]).num_kv_heads
        self.cache = PagedKVCache(attn_backend, mesh, 1, kv_heads, arch.head_dim,
                                  self.block_size, self.dtype)
        self.kv_cache: jax.Array | None = None
        self.hidden_cache: jax.Array | None = None
        self.follow_fn, self.propose_fn = eagle_functions(
            graphdef, jax.tree.structure(state), target.head_logits, buckets.max_num_seqs,
            buckets.max_blocks_per_req, self.k, self.block_size, mc.max_model_len,
            NamedSharding(mesh, P()))
        self.propose_buckets = propose_buckets(buckets)

    def bytes_per_block(self) -> int:
        return self.cache.bytes_per_block() + \
            self.block_size * self.hidden_size * self.dtype.itemsize

    def allocate(self, num_blocks: int) -> None:
        """The head's caches, as many blocks as the target's (the same block ids)."""
        self.kv_cache = self.cache.allocate(num_blocks)
        self.hidden_cache = jax.device_put(
            jnp.zeros((num_blocks * self.block_size, self.hidden_size), self.dtype),
            NamedSharding(self.mesh, P()))

    def follow(self, packed: np.ndarray, drafts: jax.Array, hidden: Any = None) -> None:
        self.kv_cache, self.hidden_cache = self.follow_fn(
            self.state, self.kv_cache, self.hidden_cache, packed, drafts, hidden)

    def run_propose(self, packed: np.ndarray) -> jax.Array:
        self.kv_cache, drafts = self.propose_fn(self.state, self.kv_cache, self.hidden_cache,
                                                packed)
        return drafts

    def dummy_hidden(self, num_tokens: int) -> jax.Array:
        return jax.device_put(jnp.zeros((num_tokens, self.captured_width), self.dtype),
                              NamedSharding(self.mesh, P()))


def make_drafter(config: EngineConfig, mesh: Any, attn_backend: Any, swiglu: Any,
                 buckets: Buckets, target: Any, groups: KVCacheGroups) -> DraftModel | None:
    """The device proposer of the speculative method (a draft model or an EAGLE head
    over `target`), else None. `groups`: the target's KV cache groups."""
    if config.eagle_head is None:
        return DraftModel.load(config, mesh, attn_backend, swiglu, buckets, groups)
    if groups.num_groups > 1:
        # The head reads one table and the target's final or aux states of every layer.
        raise ParameterError("speculative_config.method",
                             f"an {config.eagle_head.method} head for a target with "
                             "sliding-window KV cache groups (Gemma) is not supported")
    return EagleDrafter(config, mesh, attn_backend, swiglu, buckets, target)
