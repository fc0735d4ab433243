"""BlockPool, its LRU free queue, and chained block hashes."""

import subprocess
import sys

import pytest

from jaxllm.core.block_hash import (
    ROOT_HASH,
    hash_block_tokens,
    hash_request_tokens,
    make_block_hasher,
)
from jaxllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxllm.core.request import Request
from jaxllm.sampling_params import SamplingParams

# ------------------------------------------------------------------ block hashes


def test_same_tokens_under_different_parents_hash_differently():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(a, [5, 6, 7, 8])
    c = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert b != c
    assert hash_block_tokens(a, [5, 6, 7, 8]) == b


def test_first_block_hash_is_chained_from_the_root():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(ROOT_HASH, [1, 2])


def test_extra_keys_change_the_hash():
    assert hash_block_tokens(None, [1, 2], ("lora", 1)) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("lora", 1)) != hash_block_tokens(None, [1, 2],
                                                                            ("lora", 2))


def test_token_boundaries_do_not_alias():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [1, 0])


def test_block_hash_is_a_deterministic_digest_across_processes():
    code = ("from jaxllm.core.block_hash import hash_block_tokens as h;"
            "print(h(h(None, [1, 2, 3]), [4, 5, 6], ('x', 7)).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={"PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2")}
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3]), [4, 5, 6], ("x", 7)).hex()
    assert outs == {here}
    assert len(bytes.fromhex(here)) == 32


def test_only_full_blocks_get_hashes():
    assert len(hash_request_tokens(4, list(range(11)))) == 2
    assert hash_request_tokens(4, [1, 2, 3]) == []


def test_request_hashes_grow_incrementally_as_blocks_fill():
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(), block_hasher=make_block_hasher(4))
    assert req.block_hashes == hash_request_tokens(4, [1, 2, 3, 4])
    for tok in (6, 7):
        req.append_output_token_ids(tok)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids(8)
    assert req.block_hashes == hash_request_tokens(4, list(range(1, 9)))


def test_hash_next_block_matches_hashing_the_whole_sequence():
    """The decode path's batched hasher gives the hashes of the general one, also for a
    request whose hashes lag by more than one block and one with another hasher."""
    hasher, other = make_block_hasher(4), make_block_hasher(4)
    one = Request("one", [1, 2, 3], SamplingParams(), block_hasher=hasher)
    lagging = Request("lag", [9] * 3, SamplingParams(), block_hasher=hasher)
    foreign = Request("foreign", [5, 6, 7], SamplingParams(), block_hasher=other)
    # Appended without hashing, as the scheduler's array path does.
    one.all_token_ids.append(4)
    lagging.all_token_ids.extend([8] * 5)
    foreign.all_token_ids.append(8)
    hasher.hash_next_block([one, lagging, foreign])
    for req in (one, lagging, foreign):
        assert req.block_hashes == hash_request_tokens(4, req.all_token_ids)
    assert len(lagging.block_hashes) == 2
    one.all_token_ids.extend([5, 6, 7, 8])
    hasher.hash_next_block([one])
    assert one.block_hashes == hash_request_tokens(4, list(range(1, 9)))


# ------------------------------------------------------------------ free queue


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 3]
    assert len(q) == 2


def test_free_queue_rejects_double_append_and_foreign_remove():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.append(blocks[0])
    q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


# ------------------------------------------------------------------ block pool


def test_null_block_is_reserved_and_never_handed_out():
    pool = BlockPool(4)
    assert pool.get_num_free_blocks() == 3
    blocks = pool.get_new_blocks(3)
    assert 0 not in {b.block_id for b in blocks}
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_pool_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_least_recently_freed_block_is_evicted_first():
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c])
    pool.free_blocks([a])
    pool.free_blocks([d])
    pool.free_blocks([b])
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [3, 1, 4, 2]


def test_blocks_freed_together_are_evicted_in_the_order_given():
    # The KV manager passes a request's blocks tail first, so its last blocks go first.
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks))
    assert pool.get_new_blocks(4) == blocks[::-1]


def test_freed_cached_block_stays_findable_until_evicted():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([blk], [h], 0, 1)
    pool.free_blocks([blk])
    assert pool.get_cached_block(h) is blk and blk.ref_cnt == 0
    # The plain free block 2 is at the head; the cached one survives one more allocation.
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is blk
    (again,) = pool.get_new_blocks(1)
    assert again is blk and blk.block_hash is None
    assert pool.get_cached_block(h) is None


def test_touch_takes_a_cached_free_block_out_of_the_free_queue():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [7])
    pool.cache_full_blocks([blk], [h], 0, 1)
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 3
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert blk not in list(pool.free_block_queue)
    pool.touch([blk])  # a second sharer only adds a reference
    assert blk.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 3


def test_freeing_more_often_than_taken_raises_instead_of_going_negative():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError):
        pool.free_blocks([blk])
    assert blk.ref_cnt == 0


def test_a_hash_maps_to_one_block_and_duplicates_stay_plain():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    assert pool.num_cached_blocks == 1


def test_caching_disabled_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([blk], [hash_block_tokens(None, [1])], 0, 1)
    assert blk.block_hash is None and pool.num_cached_blocks == 0


def test_reset_prefix_cache_is_refused_while_blocks_are_owned():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks([blk], [h], 0, 1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and blk.block_hash is None


def test_usage_counts_owned_blocks_over_usable_blocks():
    pool = BlockPool(5)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == 0.5
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0


def test_block_hashes_are_keyed_by_lora_adapter():
    from jaxllm.core.block_hash import make_block_hasher
    from jaxllm.core.request import Request
    from jaxllm.lora.request import LoRARequest

    hasher = make_block_hasher(4)
    tokens = list(range(1, 9))

    def hashes(lora):
        return Request("r", tokens, None, block_hasher=hasher, lora_request=lora).block_hashes

    base, one, two = hashes(None), hashes(LoRARequest("a", 1, "/a")), hashes(
        LoRARequest("b", 2, "/b"))
    assert base == hash_request_tokens(4, tokens)
    assert len(one) == 2 and not set(one) & set(base) and not set(one) & set(two)
    assert one == hashes(LoRARequest("a", 1, "/a"))
