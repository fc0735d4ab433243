"""How a model's layers share the paged KV cache: groups of layers that attend alike.

vLLM's hybrid KV cache layout. Layers with the same attention (full, or one
sliding window W) are split into groups of `group_size` layers; each group keeps
its own block table per request, every group draws block ids from one shared
pool, and block id b of a group is page `slot * num_blocks + b` of its layer at
`slot`, so the cache holds `group_size * num_blocks` pages. A sliding-window
group lets go of a request's blocks that fell out of its window
(core/kv_cache_manager.py): with Gemma 3's five local layers per global one,
five groups in six hold O(W) blocks per request instead of O(context).

A model whose layers all attend alike (Llama; Mistral's single window too) is
one group of all its layers with full attention: the layout without groups,
layer l's block b at page `l * num_blocks + b`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    """The grouping of one model's layers; full-attention groups come first."""

    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its page slot within a block id
    group_size: int  # layers per group: the pages one block id stands for

    @classmethod
    def from_windows(cls, windows: Sequence[int | None]) -> KVCacheGroups:
        """Groups for layers with these sliding windows (None: full attention).

        vLLM's rule: the group size is the fewest layers of one attention type, so
        that each type fills its groups, unless the most layers of one type are
        under 1.5x that, when it is the most (12 sliding-window and 13 full layers
        make two groups of 13, not three of 12 with 11 idle slots). A type spreads
        its layers over its groups by stride (group g takes its layers g, g + n,
        ...), so where its count is not a multiple of the size the spare slots
        fall one to a group at the end."""
        n = len(windows)
        if n == 0:
            raise ValueError("a model needs at least one layer")
        if len(set(windows)) == 1:
            return cls((None,), (0,) * n, tuple(range(n)), n)
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        layers_of = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
        counts = [len(v) for v in layers_of.values()]
        size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
        group_windows: list[int | None] = []
        layer_group, layer_slot = [0] * n, [0] * n
        for w in kinds:
            layers = layers_of[w]
            num = -(-len(layers) // size)
            for g in range(num):
                for slot, layer in enumerate(layers[g::num]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(w)
        return cls(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        """Some group drops out-of-window blocks."""
        return any(w is not None for w in self.windows)


FULL_ATTENTION = KVCacheGroups.from_windows((None,))


def blocks_per_request(windows: Sequence[int | None], num_tokens: int, block_size: int,
                       max_chunk: int) -> int:
    """The most blocks, over all groups, one request of `num_tokens` tokens holds when
    it computes at most `max_chunk` tokens a step. A sliding-window group holds the
    blocks its next queries can see and those the chunk fills: the blocks of
    `window - 1 + chunk` consecutive tokens, one more where they straddle a boundary."""
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, -(-(w - 1 + max_chunk) // block_size) + 1)
               for w in windows)


def max_request_tokens(windows: Sequence[int | None], num_blocks: int, block_size: int,
                       max_chunk: int, max_model_len: int) -> int:
    """The longest request (at most `max_model_len`) whose blocks fit `num_blocks`."""
    lo, hi = 0, max_model_len
    while lo < hi:  # the largest n with blocks_per_request(n) <= num_blocks
        mid = (lo + hi + 1) // 2
        if blocks_per_request(windows, mid, block_size, max_chunk) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
