"""KVCacheManager: block tables, prefix-cache lookups, all-or-nothing allocation."""

from jaxllm.core.block_hash import make_block_hasher
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.sampling_params import PoolingParams, SamplingParams

BS = 4


def make_request(req_id, tokens, **params):
    return Request(req_id, list(tokens), SamplingParams(**params),
                   block_hasher=make_block_hasher(BS))


def run_prompt(mgr, req):
    """Allocates and 'computes' the whole prompt of a fresh request, with prefix hits."""
    hits, num_hit = mgr.get_computed_blocks(req)
    # num_computed_tokens excludes the hits until they are taken.
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hits, num_hit


def test_allocation_covers_exactly_the_tokens_asked_for():
    mgr = KVCacheManager(10, BS)
    req = make_request("a", range(9))
    blocks = mgr.allocate_slots(req, 9)
    assert len(blocks) == 3 and mgr.get_block_ids("a") == [b.block_id for b in blocks]
    req.num_computed_tokens = 9
    assert mgr.allocate_slots(req, 3) == []  # still fits in the third block
    assert len(mgr.allocate_slots(req, 4)) == 1


def test_repeated_prompt_hits_its_longest_cached_prefix():
    mgr = KVCacheManager(20, BS)
    run_prompt(mgr, make_request("a", range(10)))
    hits, num_hit = mgr.get_computed_blocks(make_request("b", [*range(10), 99, 98]))
    assert num_hit == 8 and [b.block_id for b in hits] == mgr.get_block_ids("a")[:2]
    hits, num_hit = mgr.get_computed_blocks(make_request("c", [0, 1, 2, 3, 5, 5, 5, 5, 5]))
    assert num_hit == 4


def test_with_an_eagle_head_a_hit_gives_up_its_last_block():
    """The head's KV at a block's last position reads the next block's first token, so
    the last hit block is recomputed (as vLLM does with EAGLE)."""
    mgr = KVCacheManager(20, BS, use_eagle=True)
    run_prompt(mgr, make_request("a", range(10)))
    hits, num_hit = mgr.get_computed_blocks(make_request("b", [*range(10), 99, 98]))
    assert num_hit == 4 and [b.block_id for b in hits] == mgr.get_block_ids("a")[:1]
    assert mgr.get_computed_blocks(make_request("c", [0, 1, 2, 3, 5, 5, 5, 5, 5])) == ([], 0)


def test_hit_never_covers_the_whole_prompt_so_the_last_token_is_computed():
    mgr = KVCacheManager(20, BS)
    run_prompt(mgr, make_request("a", range(8)))
    _, num_hit = mgr.get_computed_blocks(make_request("b", range(8)))
    assert num_hit == 4


def test_prompt_logprobs_and_pooling_requests_skip_the_lookup():
    mgr = KVCacheManager(20, BS)
    run_prompt(mgr, make_request("a", range(9)))
    assert mgr.get_computed_blocks(make_request("b", range(9), prompt_logprobs=1)) == ([], 0)
    pooled = Request("p", list(range(9)), None, PoolingParams(),
                     block_hasher=make_block_hasher(BS))
    assert mgr.get_computed_blocks(pooled) == ([], 0)


def test_prefix_cache_stats_count_tokens_cumulatively():
    mgr = KVCacheManager(20, BS)
    run_prompt(mgr, make_request("a", range(9)))
    run_prompt(mgr, make_request("b", range(9)))
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)


def test_a_lookup_counts_once_when_its_request_is_admitted():
    mgr = KVCacheManager(20, BS)
    run_prompt(mgr, make_request("a", range(9)))
    b = make_request("b", range(9))
    for _ in range(3):  # a request that cannot be admitted yet is looked up every step
        hits, _ = mgr.get_computed_blocks(b)
    assert mgr.prefix_cache_stats.requests == 1
    mgr.allocate_slots(b, 1, hits)
    b.num_computed_tokens = 9
    mgr.allocate_slots(b, 1)  # a decode is no lookup
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)


def test_hits_share_blocks_by_reference():
    mgr = KVCacheManager(20, BS)
    a, b = make_request("a", range(9)), make_request("b", range(9))
    run_prompt(mgr, a)
    run_prompt(mgr, b)
    shared = mgr.get_blocks("a")[:2]
    assert mgr.get_blocks("b")[:2] == shared and all(blk.ref_cnt == 2 for blk in shared)
    mgr.free(a)
    assert all(blk.ref_cnt == 1 for blk in shared)
    mgr.free(b)
    assert mgr.get_num_free_blocks() == 19


def test_failed_allocation_returns_none_and_changes_nothing():
    mgr = KVCacheManager(4, BS)  # 3 usable blocks
    run_prompt(mgr, a := make_request("a", range(8)))  # 2 blocks, both cached
    assert mgr.allocate_slots(make_request("b", range(50, 58)), 8) is None  # 1 block left
    assert mgr.get_block_ids("b") == [] and mgr.get_num_free_blocks() == 1
    mgr.free(a)
    c = make_request("c", [*range(8), *range(100, 112)])  # 2 hits + 3 new blocks > 3
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8
    assert mgr.allocate_slots(c, 12, hits) is None
    assert mgr.get_num_free_blocks() == 3 and all(blk.ref_cnt == 0 for blk in hits)
    assert mgr.get_block_ids("c") == []
    assert [mgr.block_pool.get_cached_block(h) for h in c.block_hashes[:2]] == hits


def test_cached_free_hits_count_against_free_blocks():
    mgr = KVCacheManager(4, BS)
    run_prompt(mgr, a := make_request("a", range(8)))
    mgr.free(a)
    b = make_request("b", [*range(8), 50, 51, 52, 53, 54])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    # 3 free blocks, but two of them are the hits: 2 more are needed, 1 is left.
    assert mgr.allocate_slots(b, 5, hits) is None
    assert mgr.allocate_slots(b, 4, hits) is not None
    assert mgr.get_num_free_blocks() == 0


def test_block_filled_by_decoding_joins_the_prefix_cache():
    mgr = KVCacheManager(10, BS)
    a = make_request("a", range(6))
    run_prompt(mgr, a)
    for tok in (6, 7):
        a.append_output_token_ids(tok)
        assert mgr.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    # Tokens 0..7 now fill two blocks; a request with the same 9 tokens hits both.
    _, num_hit = mgr.get_computed_blocks(make_request("b", range(9)))
    assert num_hit == 8


def test_free_returns_every_block_and_evicts_the_tail_first():
    mgr = KVCacheManager(5, BS)
    a = make_request("a", range(12))
    run_prompt(mgr, a)
    ids = mgr.get_block_ids("a")
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 4 and mgr.get_block_ids("a") == []
    order = [b.block_id for b in mgr.block_pool.free_block_queue]
    assert order[-3:] == ids[::-1]


def test_disabled_caching_never_hits():
    mgr = KVCacheManager(10, BS, enable_caching=False)
    run_prompt(mgr, make_request("a", range(9)))
    assert mgr.get_computed_blocks(make_request("b", range(9))) == ([], 0)


def test_reset_prefix_cache_forgets_hashes_once_all_blocks_are_free():
    mgr = KVCacheManager(10, BS)
    run_prompt(mgr, a := make_request("a", range(9)))
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(make_request("b", range(9))) == ([], 0)


def test_usage_tracks_owned_blocks():
    mgr = KVCacheManager(5, BS)
    run_prompt(mgr, a := make_request("a", range(8)))
    assert mgr.usage == 0.5
    mgr.free(a)
    assert mgr.usage == 0.0


def test_extend_running_many_stops_at_the_first_request_the_pool_cannot_serve():
    mgr = KVCacheManager(6, BS)  # 5 usable blocks
    reqs = [make_request(r, range(4)) for r in "abc"]
    for req in reqs:
        run_prompt(mgr, req)  # one full block each: 2 left
    new_ids, held, registered = mgr.extend_running_many(reqs, [5, 4, 12])
    # a gets a block, b needs none, c needs two and only one is free: stop there.
    assert [len(ids) for ids in new_ids] == [1, 0] and held == [2, 1]
    assert registered == [1, 1]  # each prompt's full block is registered
    assert mgr.block_state("c") == (1, 1) and mgr.get_num_free_blocks() == 1
