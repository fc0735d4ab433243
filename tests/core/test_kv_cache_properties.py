"""KVCacheManager and BlockPool driven directly by a hypothesis state machine.

Random admits (prefix-cache lookup, then a chunk), chunked extends, decodes,
preemptions, finishes and prefix-cache resets over a tiny vocabulary, so prompts
share prefixes and decoded blocks repeat cached ones. A simulated KV cache records
which token prefix each slot's KV was computed from, so the test sees whether a
prefix-cache hit hands back the right KV, not only whether the counters add up.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jaxllm.core.block_hash import hash_request_tokens, make_block_hasher
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.sampling_params import SamplingParams

VOCAB = 3  # tiny, so that random tails and decodes often repeat cached blocks
BASE_LEN = 16


class Sim:
    """A KVCacheManager plus the KV a model runner would have written into its blocks.

    kv[block_id][slot] is the token prefix whose last token's KV sits in that slot:
    the KV of a position depends on every token up to it.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}

    def write(self, request: Request, pos: int) -> None:
        bs = self.mgr.block_size
        block = self.mgr.get_blocks(request.request_id)[pos // bs]
        # Only a block's sole owner computes into it; a shared block is a read-only hit.
        assert block.ref_cnt == 1, (block, pos)
        slots = self.kv.setdefault(block.block_id, [None] * bs)
        slots[pos % bs] = tuple(request.all_token_ids[:pos + 1])

    def full_prefix(self, block_id: int) -> tuple[int, ...] | None:
        """The token prefix a full block's KV was computed from, None unless all
        its slots hold the KV of one prefix."""
        slots = self.kv.get(block_id)
        if not slots or slots[-1] is None:
            return None
        last, bs = slots[-1], self.mgr.block_size
        ok = len(last) % bs == 0 and all(
            s == last[:len(last) - bs + j + 1] for j, s in enumerate(slots))
        return last if ok else None

    def fingerprint(self) -> tuple:
        """Everything observable about the pool and the block tables, by block id."""
        mgr, pool = self.mgr, self.mgr.block_pool
        return (tuple((b.ref_cnt, b.block_hash) for b in pool.blocks),
                tuple(b.block_id for b in pool.free_block_queue),
                pool.num_cached_blocks,
                tuple(sorted((rid, tuple(b.block_id for b in blocks), mgr.block_state(rid))
                             for rid, blocks in mgr.req_to_blocks.items())),
                tuple(vars(mgr.prefix_cache_stats).items()))


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


class KVCacheMachine(RuleBasedStateMachine):
    """One manager driven the way the scheduler drives it."""

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(2, 24),
                caching=st.sampled_from([True, True, True, False]),
                bases=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=BASE_LEN,
                                        max_size=BASE_LEN), min_size=1, max_size=3))
    def setup(self, block_size, num_blocks, caching, bases):
        self.bs, self.caching, self.bases = block_size, caching, bases
        self.num_blocks = num_blocks
        self.sim = Sim(num_blocks, block_size, caching)
        self.mgr = self.sim.mgr
        self.hasher = make_block_hasher(block_size)
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []  # refused or preempted, num_computed_tokens == 0
        self.written: dict[str, int] = {}  # positions whose KV is in the request's blocks
        self.num_cached: dict[str, int] = {}  # expected block_state()[1]
        self.next_id = 0

    # ---------------------------------------------------------------- helpers

    def new_request(self, data) -> Request:
        base = data.draw(st.sampled_from(self.bases))
        prompt = base[:data.draw(st.integers(0, BASE_LEN))]
        prompt += data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3,
                                     min_size=0 if prompt else 1))
        self.next_id += 1
        return Request(f"r{self.next_id}", prompt, SamplingParams(),
                       block_hasher=self.hasher)

    def room(self, req: Request) -> int:
        # One position past the known tokens: async scheduling allocates the slot of
        # a token still being sampled.
        return req.num_tokens + 1 - req.num_computed_tokens

    def extendable(self) -> list[str]:
        return sorted(rid for rid, r in self.running.items() if self.room(r) > 0)

    def unchanged_if_none(self, sim: Sim, call):
        before = sim.fingerprint()
        result = call()
        if result is None:
            assert sim.fingerprint() == before
        return result

    def computed(self, req: Request, num_total: int) -> None:
        """Books a successful allocation up to `num_total` and 'runs' the step."""
        req.num_computed_tokens = num_total
        self.running[req.request_id] = req
        self.num_cached[req.request_id] = (
            min(num_total // self.bs, len(req.block_hashes)) if self.caching else 0)
        self.flush(req)

    def flush(self, req: Request) -> None:
        """Writes the KV of every computed position whose token is known (the slot
        allocated ahead for a token being sampled is written once it arrives)."""
        end = min(req.num_computed_tokens, req.num_tokens)
        for pos in range(self.written.setdefault(req.request_id, 0), end):
            self.sim.write(req, pos)
        self.written[req.request_id] = max(end, self.written[req.request_id])

    # ---------------------------------------------------------------- rules

    @rule(data=st.data())
    def admit(self, data):
        if self.waiting and data.draw(st.booleans()):
            req = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        else:
            req = self.new_request(data)
        hits, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit == len(hits) * self.bs
        # A hit never covers the last token: it must be computed to have logits.
        assert num_hit < req.num_tokens
        if not self.caching:
            assert not hits
        # The longest cached prefix, and the KV in it is this request's prefix.
        pool = self.mgr.block_pool
        for i, block in enumerate(hits):
            assert pool.get_cached_block(req.block_hashes[i]) is block
            assert self.sim.full_prefix(block.block_id) == tuple(
                req.all_token_ids[:(i + 1) * self.bs])
        if self.caching and len(hits) < (req.num_tokens - 1) // self.bs:
            assert pool.get_cached_block(req.block_hashes[len(hits)]) is None
        event(f"admit with {'a' if hits else 'no'} prefix hit")

        num_new = data.draw(st.integers(1, req.num_tokens - num_hit))
        new = self.unchanged_if_none(self.sim,
                                     lambda: self.mgr.allocate_slots(req, num_new, hits))
        if new is None:
            event("admit refused")
            self.waiting.append(req)
            return
        self.written[req.request_id] = num_hit  # the hits hold KV already
        self.computed(req, num_hit + num_new)

    @precondition(lambda self: self.extendable())
    @rule(data=st.data(), via_allocate_slots=st.booleans())
    def extend_one(self, data, via_allocate_slots):
        req = self.running[data.draw(st.sampled_from(self.extendable()))]
        k = data.draw(st.integers(1, self.room(req)))
        num_total = req.num_computed_tokens + k
        new = self.unchanged_if_none(self.sim, lambda: (
            self.mgr.allocate_slots(req, k) if via_allocate_slots
            else self.mgr.extend_running(req, num_total)))
        if new is None:
            event("extend refused")
            return
        self.computed(req, num_total)

    @precondition(lambda self: any(r.num_computed_tokens >= r.num_tokens
                                   for r in self.running.values()))
    @rule(data=st.data())
    def append_tokens(self, data):
        """Sampled tokens arrive: often the continuation of a base sequence, so a
        block filled by decoding repeats a cached one."""
        rid = data.draw(st.sampled_from(sorted(
            rid for rid, r in self.running.items() if r.num_computed_tokens >= r.num_tokens)))
        req = self.running[rid]
        for _ in range(data.draw(st.integers(1, 3))):
            base = data.draw(st.sampled_from(self.bases))
            n = req.num_tokens
            continues = n < BASE_LEN and data.draw(st.booleans())
            req.append_output_token_ids(
                base[n] if continues else data.draw(st.integers(0, VOCAB - 1)))
        self.flush(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.mgr.free(req)
        assert self.mgr.block_state(req.request_id) == (0, 0)
        del self.written[req.request_id], self.num_cached[req.request_id]
        if preempt:  # back to waiting, to be recomputed from its prompt and outputs
            req.num_computed_tokens = 0
            self.waiting.append(req)

    @precondition(lambda self: self.mgr.block_pool.num_cached_blocks)
    @rule()
    def reset_prefix_cache(self):
        before = self.sim.fingerprint()
        done = self.mgr.reset_prefix_cache()
        # Refused exactly while some block is owned (every running request owns one).
        assert done == (not self.running)
        if done:
            pool = self.mgr.block_pool
            assert pool.num_cached_blocks == 0
            assert all(b.block_hash is None for b in pool.blocks)
        else:
            assert self.sim.fingerprint() == before

    # ---------------------------------------------------------------- invariants

    @invariant()
    def every_block_is_free_cached_free_or_owned_by_its_holders(self):
        mgr, pool = self.mgr, self.mgr.block_pool
        queue = list(pool.free_block_queue)
        assert len(queue) == pool.free_block_queue.num_free_blocks \
            == pool.get_num_free_blocks() == len({b.block_id for b in queue})
        # The linked list is consistent both ways and ends at its sentinels.
        for a, b in zip(queue, queue[1:], strict=False):
            assert a.next_free_block is b and b.prev_free_block is a
        if queue:
            assert queue[0].prev_free_block.block_id == -1
            assert queue[-1].next_free_block.block_id == -1
        in_queue = {b.block_id for b in queue}
        holders = Counter()
        for rid in self.running:
            table = ids(mgr.get_blocks(rid))
            assert len(table) == len(set(table))
            holders.update(table)
        assert set(mgr.req_to_blocks) == set(self.running)

        null = pool.blocks[0]
        assert null.is_null and null.ref_cnt == 0 and null.block_hash is None
        assert 0 not in in_queue and 0 not in holders
        num_owned = 0
        for block in pool.blocks[1:]:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in in_queue)
            if block.ref_cnt > 0:
                num_owned += 1
                assert block.prev_free_block is None and block.next_free_block is None
        assert pool.get_num_free_blocks() + num_owned == self.num_blocks - 1

    @invariant()
    def prefix_cache_maps_each_hash_to_one_block_holding_that_prefix(self):
        pool = self.mgr.block_pool
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        if not self.caching:
            assert not hashed and pool.num_cached_blocks == 0
        # Every hashed block is the map's entry for its hash, and the map holds
        # nothing else: a bijection between hashes and hashed blocks.
        assert all(pool.get_cached_block(b.block_hash) is b for b in hashed)
        assert pool.num_cached_blocks == len(hashed)
        # Owned or cached-free, a hashed block holds the KV of the prefix it hashes.
        for block in hashed:
            prefix = self.sim.full_prefix(block.block_id)
            assert prefix is not None, block
            assert hash_request_tokens(self.bs, prefix)[-1] == block.block_hash

    @invariant()
    def requests_hold_the_kv_of_their_own_tokens(self):
        for req in self.running.values():
            rid, tokens = req.request_id, req.all_token_ids
            assert req.block_hashes == hash_request_tokens(self.bs, tokens)
            table = self.mgr.get_blocks(rid)
            assert len(table) == -(-req.num_computed_tokens // self.bs)
            assert self.mgr.block_state(rid) == (len(table), self.num_cached[rid])
            for i, block in enumerate(table):
                if block.block_hash is not None:
                    assert block.block_hash == req.block_hashes[i]
            for pos in range(self.written[rid]):
                slots = self.sim.kv[table[pos // self.bs].block_id]
                assert slots[pos % self.bs] == tuple(tokens[:pos + 1]), (rid, pos)


@pytest.mark.slow
def test_random_workloads_keep_blocks_accounted_and_cached_kv_right():
    """After every step: each block is exactly one of free / cached-free / owned, ref
    counts equal the requests holding a block, the free queue's links agree with its
    count, the hash map is a bijection onto hashed blocks whose (simulated) KV is the
    prefix they hash, prefix hits are the longest cached prefix short of the last
    token, and a refused allocation changes nothing."""
    run_state_machine_as_test(KVCacheMachine, settings=settings(
        max_examples=300, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
