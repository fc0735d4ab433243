"""The draft model of speculative decoding: a smaller model on the target's vocabulary
that proposes each step's drafts on the device.

It keeps a paged KV cache of its own, with as many blocks as the target's, and
reads the target's block tables: a block id names the same tokens in both
caches, so prefix-cache hits and preemption need nothing more. With KV cache
groups (a Gemma target: jaxllm/kv_groups.py) it reads the first group's table,
whose full attention keeps every block of the context, and holds every one of
its own layers' pages there, windowed or not: the sliding-window groups'
tables lose the blocks their window passed, which a draft's other layers may
still read. Every target
forward is mirrored by the draft's on the same packed inputs (`follow`), which
keeps its cache in step through prefills, chunked or not, and verify steps.

The scheduler schedules a drafting request's k drafts as placeholders (the
runner tells it how many come) and allocates their blocks; at the verify
step's dispatch `propose` runs k one-token steps of the draft from each
request's last token, greedy, and the verify forward reads the drafts from its
output (the packed inputs' `src` names them). A greedy draft is a one-hot draft
distribution, so the rejection sampler keeps the target's exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import EngineConfig
from jaxllm.errors import ParameterError
from jaxllm.kv_groups import KVCacheGroups
from jaxllm.models.loader import kv_cache_spec, load_model
from jaxllm.quant_config import kv_cache_dtype
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.input_batch import InputBatch
from jaxllm.worker.kv_cache import PagedKVCache
from jaxllm.worker.step_inputs import StepInputs, pack_step_inputs, src_view, unpack_step_inputs


@functools.cache
def draft_functions(graphdef: Any, state_def: Any, num_reqs: int, width: int, k: int,
                    block_size: int, max_len: int, num_groups: int = 1) -> tuple[Any, Any]:
    """The jitted `follow` and `propose` of one draft model graph; `follow` reads the
    target's packed inputs (`num_groups` tables a request), `propose` its own (one)."""

    def merge(weights):
        return nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))

    def follow(weights, kv_cache, packed, drafts):
        """The target's step on the draft: its KV for every scheduled token."""
        input_ids, positions, md, src, _ = unpack_step_inputs(packed, num_reqs, width,
                                                              num_groups)
        input_ids = jnp.where(src >= 0, drafts.reshape(-1)[jnp.maximum(src, 0)], input_ids)
        if md.grouped:  # the full-attention group's slots and tables
            md = md.for_group(0)
        _, kv_cache = merge(weights)(input_ids, positions, kv_cache, md)
        return kv_cache

    def propose(weights, kv_cache, packed):
        """`[num_reqs, k]` greedy drafts: token i is request i's last token; the
        output-index column carries each request's draft count (steps past it
        write no KV: their blocks may not be the request's)."""
        input_ids, positions, md, _, num_drafts = unpack_step_inputs(packed, num_reqs, width)
        model = merge(weights)
        t = input_ids.shape[0]
        n = md.num_seqs[0]
        tok = jnp.arange(t)
        req = jnp.minimum(tok, num_reqs - 1)
        counts = jnp.where(tok < n, num_drafts[req], 0)
        pages = md.page_indices[req]
        req_pos = positions[jnp.minimum(jnp.arange(num_reqs), t - 1)]
        live = jnp.arange(num_reqs) < n

        def step(s, carry):
            kv_cache, tokens, drafts = carry
            pos = jnp.minimum(positions + s, max_len - 1)
            slot = pages[tok, pos // block_size] * block_size + pos % block_size
            step_md = dataclasses.replace(
                md, slot_mapping=jnp.where(s < counts, slot, 0).astype(jnp.int32),
                kv_lens=jnp.where(live, jnp.minimum(req_pos + s, max_len - 1) + 1,
                                  0).astype(jnp.int32))
            states, kv_cache = model(tokens, pos, kv_cache, step_md)
            nxt = jnp.argmax(model.compute_logits(states), axis=-1).astype(jnp.int32)
            return kv_cache, nxt, drafts.at[:, s].set(nxt)

        kv_cache, _, drafts = jax.lax.fori_loop(
            0, k, step, (kv_cache, input_ids, jnp.zeros((t, k), jnp.int32)))
        drafts = drafts[:num_reqs] if t >= num_reqs else jnp.pad(
            drafts, ((0, num_reqs - t), (0, 0)))
        return kv_cache, drafts

    return (jax.jit(follow, donate_argnums=(1,)), jax.jit(propose, donate_argnums=(1,)))


def propose_buckets(buckets: Buckets) -> list[int]:
    """Proposals run one token per request: the token buckets that hold a step's requests."""
    top = buckets.pad_tokens(min(buckets.max_num_seqs, buckets.token_buckets[-1]))
    return [t for t in buckets.token_buckets if t <= top]


class DraftModel:
    """The draft model's weights, KV cache and programs beside one runner."""

    def __init__(self, config: EngineConfig, mesh: Any, attn_backend: Any, swiglu: Any,
                 buckets: Buckets):
        self.num_groups = buckets.num_kv_groups
        mc = config.draft_model_config
        self.buckets = buckets
        self.k = config.speculative_config.num_speculative_tokens
        model = load_model(mc, mesh, attn_backend, swiglu)
        graphdef, state = nnx.split(model)
        self.state = jax.tree.leaves(state)
        layers, kv_heads, head_dim = kv_cache_spec(mc.hf_config, mesh.shape["model"])
        self.cache = PagedKVCache(attn_backend, mesh, layers, kv_heads, head_dim,
                                  config.cache_config.block_size, jnp.dtype(kv_cache_dtype(mc)))
        self.kv_cache: jax.Array | None = None
        self.follow_fn, self.propose_fn = draft_functions(
            graphdef, jax.tree.structure(state), buckets.max_num_seqs,
            buckets.max_blocks_per_req, self.k, config.cache_config.block_size,
            mc.max_model_len, self.num_groups)
        self.propose_buckets = propose_buckets(buckets)

    @classmethod
    def load(cls, config: EngineConfig, mesh: Any, attn_backend: Any, swiglu: Any,
             buckets: Buckets, groups: KVCacheGroups) -> DraftModel | None:
        """The draft model where the speculative method runs one, else None. `groups`:
        the target's KV cache groups."""
        if config.draft_model_config is None:
            return None
        if groups.windows[0] is not None:
            # No group keeps the whole context: every table loses out-of-window blocks.
            raise ParameterError("speculative_config.method",
                                 "a draft model needs a target with a full-attention layer; "
                                 f"this one's layers all attend in sliding windows "
                                 f"{sorted(set(groups.windows))}; use 'ngram'")
        return cls(config, mesh, attn_backend, swiglu, buckets)

    def bytes_per_block(self) -> int:
        return self.cache.bytes_per_block()

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache, as many blocks as the target's (the same block ids)."""
        self.kv_cache = self.cache.allocate(num_blocks)

    def follow(self, packed: np.ndarray, drafts: jax.Array, hidden: Any = None) -> None:
        """The draft's mirror of a target forward (`hidden`: what the forward captured
        for an EAGLE head; none here)."""
        self.kv_cache = self.follow_fn(self.state, self.kv_cache, packed, drafts)

    def run_propose(self, packed: np.ndarray) -> jax.Array:
        """`propose`'s device program on its packed inputs; returns the drafts."""
        self.kv_cache, drafts = self.propose_fn(self.state, self.kv_cache, packed)
        return drafts

    def dummy_hidden(self, num_tokens: int) -> Any:
        """What `follow` takes as `hidden` from a forward of `num_tokens` (precompile)."""
        return None

    def propose(self, ib: InputBatch, rows: np.ndarray, inputs: StepInputs,
                num_drafts: np.ndarray) -> jax.Array:
        """The drafts `[max_num_seqs, k]` of the step's requests (row i, request i; the
        first `num_drafts[i]` are used), and `src` in `inputs.packed` pointing the
        verify forward's draft tokens at them. The proposer starts from each request's
        next token (the one at its computed count) at that position."""
        b, n, k = self.buckets, rows.size, self.k
        t = b.pad_tokens(n)
        (packed, ids, pos, _, _, pages, kv_lens, cu_end, num_seqs,
         counts) = pack_step_inputs(t, b.max_num_seqs, b.max_blocks_per_req)
        computed = inputs.computed
        ids[:n] = ib.token_ids[rows, np.minimum(computed, ib.max_model_len - 1)]
        pos[:n] = computed
        pages[:n] = ib.block_table[rows, :b.max_blocks_per_req]  # the full-attention group's
        kv_lens[:n] = computed + 1
        cu_end[:n] = np.arange(1, n + 1)
        cu_end[n:] = n
        num_seqs[:] = n
        counts[:n] = num_drafts
        drafts = self.run_propose(packed)
        # Request i's draft j is the step's token first[i] + 1 + j.
        req = np.repeat(np.arange(n), num_drafts)
        j = np.arange(req.size) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
        src_view(inputs.packed, b.max_num_seqs, b.max_blocks_per_req, self.num_groups)[
            inputs.first[req] + 1 + j] = req * k + j
        return drafts

    def precompile(self, dummy_inputs: Any, no_drafts: jax.Array) -> jax.Array:
        """Compiles `follow` for every token bucket (with drafts made by `propose`, and
        with `no_drafts`, what steps without drafts pass) and `propose` for every bucket
        a step's requests fit; returns drafts as `propose` makes them (for the verify
        programs' precompile). `dummy_inputs(t)`: the target's packed inputs for `t`
        tokens."""
        drafts = None
        b = self.buckets
        for t in self.propose_buckets:
            drafts = self.run_propose(
                pack_step_inputs(t, b.max_num_seqs, b.max_blocks_per_req)[0])
        for t in self.buckets.token_buckets:
            for d in (drafts, no_drafts):
                self.follow(dummy_inputs(t), d, self.dummy_hidden(t))
        return drafts
