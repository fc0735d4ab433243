"""KV cache groups: how layers are grouped, and how few blocks a sliding-window group holds.

Gemma 3's layout (five sliding-window layers to each global one) at long context:
the global layers hold a block per `block_size` tokens, the local ones only what
their window reads, and the pool gets the rest back.
"""

import pytest

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.kv_groups import KVCacheGroups, blocks_per_request, max_request_tokens
from jaxllm.sampling_params import SamplingParams
from tests.core.test_scheduler import make_scheduler, sample_all

WINDOW, BS = 1024, 16
GEMMA3_LIKE = ([WINDOW] * 5 + [None]) * 2  # 12 layers: 10 local, 2 global


def test_layers_that_attend_alike_form_one_group_in_layer_order():
    for windows in ([None] * 4, [8] * 3):  # Llama; Mistral's one window for every layer
        groups = KVCacheGroups.from_windows(windows)
        assert groups.windows == (None,) and not groups.is_hybrid
        assert groups.layer_slot == tuple(range(len(windows))) and groups.group_size == len(
            windows)


def test_a_gemma3_layout_splits_into_one_global_group_and_five_local_ones():
    groups = KVCacheGroups.from_windows(GEMMA3_LIKE)
    # Groups of 2 layers (the global layers' count): the 10 local layers fill 5.
    assert groups.group_size == 2 and groups.windows == (None,) + (WINDOW,) * 5
    assert [groups.layer_group[i] for i in (5, 11)] == [0, 0]  # the global layers
    assert [groups.layer_slot[i] for i in (5, 11)] == [0, 1]
    local = [(groups.layer_group[i], groups.layer_slot[i]) for i in range(12)
             if GEMMA3_LIKE[i] is not None]
    assert sorted(local) == [(g, s) for g in range(1, 6) for s in range(2)]


def test_gemma2_alternating_layers_make_two_groups_of_half_the_layers():
    groups = KVCacheGroups.from_windows([4, None] * 3)
    assert groups.windows == (None, 4) and groups.group_size == 3
    assert groups.layer_group == (1, 0) * 3 and groups.layer_slot == (0, 0, 1, 1, 2, 2)


def test_near_equal_layer_counts_share_the_larger_group_size_as_vllm():
    """12 sliding-window and 13 full layers (a gpt-oss-like target with one more
    full layer): groups of 13, one of each type, rather than three of 12."""
    groups = KVCacheGroups.from_windows([128, None] * 12 + [None])
    assert groups.group_size == 13 and groups.windows == (None, 128)
    assert sorted(groups.layer_slot[i] for i in range(0, 24, 2)) == list(range(12))


def test_a_type_spreads_its_layers_over_its_groups_by_stride():
    """Two full and three sliding-window layers (under 1.5x: groups of 2): the local
    layers split as (0, 2) and (1,), vLLM's layout, the spare slot in the last group."""
    windows = [None, 8, 8, None, 8]
    groups = KVCacheGroups.from_windows(windows)
    assert groups.group_size == 2 and groups.windows == (None, 8, 8)
    local = [i for i, w in enumerate(windows) if w is not None]
    assert [(groups.layer_group[i], groups.layer_slot[i]) for i in local] == [
        (1, 0), (2, 0), (1, 1)]


def test_long_context_gemma3_layout_holds_a_window_of_blocks_per_local_group():
    """A 32K-token prompt in 2048-token chunks, then 64 decodes: the global group holds
    every block, each local group the window's 64 blocks and at most one more (it
    lets go when it takes a new block), about a fifth of the pages every layer holding
    every block would take, and the pool has the rest back."""
    groups = KVCacheGroups.from_windows(GEMMA3_LIKE)
    prompt_len, chunk, decodes = 32768, 2048, 64
    sched = make_scheduler(num_blocks=20000, block_size=BS, max_model_len=40000,
                           max_num_batched_tokens=chunk, caching=False,
                           windows=groups.windows)
    sched.add_request(Request("long", [5] * prompt_len, SamplingParams(max_tokens=decodes + 2,
                                                                       ignore_eos=True)))
    mgr = sched.kv_cache_manager
    for _ in range(prompt_len // chunk + decodes):
        out = sched.schedule()
        sched.update_from_output(out, sample_all(sched, out))
    req = sched.requests["long"]
    assert req.num_computed_tokens == prompt_len + decodes
    held = mgr.num_held_blocks("long")
    full_blocks = -(-req.num_computed_tokens // BS)  # 2052
    assert held[0] == full_blocks == 2052
    window_blocks = -(-(WINDOW - 1) // BS)  # 64: the blocks the next query reads
    assert all(window_blocks <= h <= window_blocks + 1 for h in held[1:]), held
    # Each block id stands for one page of each of a group's 2 layers.
    pages = groups.group_size * sum(held)
    pages_without_groups = len(GEMMA3_LIKE) * full_blocks
    assert pages / pages_without_groups < 0.2
    assert mgr.block_pool.num_usable_blocks - mgr.get_num_free_blocks() == sum(held)
    # Preemption or finish: every group's blocks go back.
    sched.finish_requests("long", req.status.FINISHED_ABORTED)
    assert mgr.get_num_free_blocks() == mgr.block_pool.num_usable_blocks


def test_dropped_blocks_become_the_null_block_and_return_to_the_pool():
    mgr = KVCacheManager(40, 4, enable_caching=False, windows=(None, 6))
    req = Request("a", list(range(20)), SamplingParams())
    assert len(mgr.allocate_slots(req, 20)) == 10  # 5 blocks in each group
    req.num_computed_tokens = 20
    free = mgr.get_num_free_blocks()
    # The next query (position 20) reads keys 15..20: blocks 0..2 (tokens 0..11) go.
    new = mgr.allocate_slots(req, 1)
    assert len(new) == 2
    table = mgr.tables[1]["a"]
    assert [b.is_null for b in table] == [True, True, True, False, False, False]
    assert mgr.get_num_free_blocks() == free - 2 + 3
    assert mgr.num_held_blocks("a") == [6, 3]
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 39


@pytest.mark.parametrize("windows", [(None,), (None, 64, 64, 64, 64, 64)])
def test_the_longest_request_is_the_longest_whose_blocks_fit(windows):
    n = max_request_tokens(windows, 100, 16, 32, 100000)
    assert blocks_per_request(windows, n, 16, 32) <= 100 < blocks_per_request(
        windows, n + 1, 16, 32)
    if windows == (None,):
        assert n == 1600
    else:
        # 100 block ids of one layer pair: the global group takes most, each local
        # group at most ceil((64 - 1 + 32) / 16) + 1 = 7.
        assert n == (100 - 5 * 7) * 16


def test_the_same_memory_fits_longer_requests_with_sliding_window_groups():
    """Memory for 600 blocks of every layer of the 12-layer layout: 3600 block ids of its
    2-layer groups. Without groups a request fits 600 * 16 tokens; with them each
    local group holds at most the window and a 2048-token chunk, ceil((1024 - 1 + 2048)
    / 16) + 1 = 193 blocks, and the global group the rest: over four times as many."""
    groups = KVCacheGroups.from_windows(GEMMA3_LIKE)
    ids = 600 * len(GEMMA3_LIKE) // groups.group_size
    without = max_request_tokens((None,), 600, BS, 2048, 10**6)
    with_groups = max_request_tokens(groups.windows, ids, BS, 2048, 10**6)
    assert without == 9600
    assert with_groups == (ids - 5 * 193) * BS == 42160
