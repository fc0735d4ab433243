"""Per-request block tables on top of the BlockPool, with prefix-cache lookups.

A model's layers form KV cache groups (jaxllm/kv_groups.py), each with its own
table per request; all draw from one pool. Every table of a request has the
same length (logical block i in each), and a sliding-window group replaces the
blocks that fell out of its window with the null block, returning them to the
pool (vLLM's hybrid KV cache manager). Lists of blocks or ids that cross this
class's boundary hold one equal run per group, in group order; with a single
group (every layer attends to everything) that is just the request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.core.block_hash import BlockHash
from jaxllm.core.block_pool import BlockPool, KVCacheBlock, group_key
from jaxllm.core.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups of admitted requests, counted in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Which physical blocks each request holds, and how to get more.

    Blocks of a request are listed in logical order: block i holds tokens
    [i * block_size, (i + 1) * block_size).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,), use_eagle: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be None or positive, one per group, got {windows}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Each group's sliding window (None: full attention) and tables.
        self.windows = tuple(windows)
        self.num_groups = len(windows)
        # One full-attention group: a request's blocks are one list, nothing is dropped.
        self._plain = self.windows == (None,)
        self.tables: list[dict[str, list[KVCacheBlock]]] = [{} for _ in windows]
        self.req_to_blocks = self.tables[0]
        # Per group: how many leading blocks of each request are the null block.
        self._num_skipped: list[dict[str, int]] = [{} for _ in windows]
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # An EAGLE head's KV at a block's last position reads the next block's first
        # token: a hit gives up its last block, recomputed (vLLM's rule).
        self.use_eagle = use_eagle

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        Never covers the whole request: its last token must be computed so
        that there are logits to sample from. Requests that want prompt
        logprobs or pooled states need every position computed, so they skip
        the lookup. With several groups, a prefix is a hit where every group
        has what the next tokens read (`_group_hit`); the blocks come as one
        run per group.
        """
        if not self._looks_up(request):
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if not self._plain:
            return self._hybrid_hit(request.block_hashes[:max_hit_blocks])
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if self.use_eagle and blocks:
            blocks.pop()
        return blocks, len(blocks) * self.block_size

    def _hybrid_hit(self, hashes: list[BlockHash]) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix every group agrees on (vLLM's rule): shortening the hit
        for one group may end another's window early, so look again until none
        shortens it."""
        n = len(hashes)
        hits: list[list[KVCacheBlock]] = []
        while len(hits) < self.num_groups:
            hits = []
            for g in range(self.num_groups):
                blocks = self._group_hit(hashes[:n], g)
                if len(blocks) < n:
                    n = len(blocks)
                    break
                hits.append(blocks)
        return [b for blocks in hits for b in blocks], n * self.block_size

    def _group_hit(self, hashes: list[BlockHash], group: int) -> list[KVCacheBlock]:
        """Group `group`'s blocks of the longest hit within `hashes`. Full attention:
        the cached prefix. A sliding window W: the longest prefix whose last
        ceil((W - 1) / block_size) blocks are cached (the next token reads no
        further back), the blocks before them null."""
        get = self.block_pool.get_cached_block
        window = self.windows[group]
        if window is None:
            blocks = []
            for block_hash in hashes:
                block = get(group_key(block_hash, group))
                if block is None:
                    break
                blocks.append(block)
            return blocks
        need = -(-(window - 1) // self.block_size)
        blocks = [self.block_pool.null_block] * len(hashes)
        run = 0
        if need == 0:
            return blocks
        for i in range(len(hashes) - 1, -1, -1):
            block = get(group_key(hashes[i], group))
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run >= need:
                return blocks[:i + run]
        return blocks[:run]  # a cached prefix shorter than the window

    def _looks_up(self, request: Request) -> bool:
        return self.enable_caching and not request.is_pooling and (
            request.sampling_params is None or request.sampling_params.prompt_logprobs is None)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens of `request`.

        `new_computed_blocks` are prefix-cache hits (from `get_computed_blocks`)
        that come before the new tokens; they are taken, not recomputed.
        Returns the newly allocated blocks (hits excluded), or None, changing
        nothing, when the free blocks do not suffice.
        """
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        if req_blocks and not new_computed_blocks and num_new_tokens >= 0:
            return self._extend(request, req_blocks, request.num_computed_tokens
                                + num_new_tokens)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        if new_computed_blocks and req_blocks:
            raise ValueError(f"{req_id!r} already holds blocks; hits only come before any")
        groups = self.num_groups
        num_hits = len(new_computed_blocks) // groups  # per group
        num_computed = request.num_computed_tokens + num_hits * self.block_size
        num_total = num_computed + num_new_tokens
        num_required = -(-num_total // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - num_hits)
        # Hits that sit cached-free in the free queue stop being free once taken.
        num_evictable_hits = sum(1 for b in new_computed_blocks
                                 if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks * groups > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        if not req_blocks and request.num_computed_tokens == 0 and self._looks_up(request):
            # Stats count a lookup once, when its request is admitted: a request
            # that waits is looked up again every step and would count many times.
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hits * self.block_size
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks * groups)
        if self._plain:
            req_blocks = self.req_to_blocks.setdefault(req_id, [])
            req_blocks.extend(new_computed_blocks)
            req_blocks.extend(new_blocks)
        else:
            for g, table in enumerate(self.tables):
                blocks = table.setdefault(req_id, [])
                blocks.extend(new_computed_blocks[g * num_hits:(g + 1) * num_hits])
                blocks.extend(new_blocks[g * num_new_blocks:(g + 1) * num_new_blocks])
                if self.windows[g] is not None:
                    self._num_skipped[g][req_id] = sum(b.is_null for b in blocks)
            req_blocks = self.req_to_blocks[req_id]

        self._cache_full(request, req_blocks, num_total)
        return new_blocks

    def extend_running(self, request: Request, num_total: int) -> list[KVCacheBlock] | None:
        """`allocate_slots` for a request that holds blocks, brings no hits and will hold
        `num_total` tokens (or `allocate_slots` for one that holds none yet)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if not req_blocks:
            return self.allocate_slots(request, num_total - request.num_computed_tokens)
        return self._extend(request, req_blocks, num_total)

    def extend_running_many(self, requests: list[Request], ends: list[int]
                            ) -> tuple[list[list[int]], list[int], list[int]]:
        """`extend_running` for each request in turn (`ends[i]`: the tokens it will
        hold), stopping at the first one the pool cannot serve, so the lists returned
        are shorter than `requests` when one could not be. For each request served:
        the ids of its new blocks, then its `block_state` after (blocks held, blocks
        registered). The scheduler's decode step: ~1 request in block_size a step."""
        new_ids: list[list[int]] = []
        held: list[int] = []
        registered: list[int] = []
        for request, end in zip(requests, ends, strict=True):
            new_blocks = self.extend_running(request, end)
            if new_blocks is None:
                break
            new_ids.append([blk.block_id for blk in new_blocks])
            num_held, num_registered = self.block_state(request.request_id)
            held.append(num_held)
            registered.append(num_registered)
        return new_ids, held, registered

    def _extend(self, request: Request, req_blocks: list[KVCacheBlock],
                num_total: int) -> list[KVCacheBlock] | None:
        """`allocate_slots` for a request that holds blocks and brings no hits.

        Sliding-window groups let go of out-of-window blocks when the request needs
        new ones (the scheduler's array path calls only then; at most one block more
        per group waits for it)."""
        num_new_blocks = -(-num_total // self.block_size) - len(req_blocks)
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0:
            if not self._plain:
                self._drop_out_of_window(request)
            groups = self.num_groups
            if num_new_blocks * groups > self.block_pool.get_num_free_blocks():
                return None
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks * groups)
            if self._plain:
                req_blocks.extend(new_blocks)
            else:
                for g, table in enumerate(self.tables):
                    table[request.request_id].extend(
                        new_blocks[g * num_new_blocks:(g + 1) * num_new_blocks])
        self._cache_full(request, req_blocks, num_total)
        return new_blocks

    def _drop_out_of_window(self, request: Request) -> None:
        """Returns to the pool each sliding-window group's blocks that no query of this
        step or a later one reads: the next query sits at `num_computed_tokens` and
        reads keys after `num_computed_tokens - window`, so blocks wholly before
        `num_computed_tokens - window + 1` go (vLLM's rule). A request preempted or
        finished frees the rest (`free`)."""
        req_id, computed = request.request_id, request.num_computed_tokens
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            skipped = self._num_skipped[g]
            first, last = skipped.get(req_id, 0), (computed - window + 1) // self.block_size
            if last <= first:
                continue
            blocks = self.tables[g][req_id]
            last = min(last, len(blocks))
            dropped = blocks[first:last]
            blocks[first:last] = [self.block_pool.null_block] * (last - first)
            skipped[req_id] = last
            self.block_pool.free_blocks(dropped)

    def _cache_full(self, request: Request, req_blocks: list[KVCacheBlock],
                    num_total: int) -> None:
        """Registers the request's blocks that `num_total` tokens fill, before they
        are computed: the runner writes a step's KV before its attention reads the
        cache, so a request scheduled later in the same step may already share
        them (vLLM does the same). Each group's blocks under its own keys."""
        if not self.enable_caching:
            return
        num_full = min(num_total // self.block_size, len(request.block_hashes))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            if self._plain:
                self.block_pool.cache_full_blocks(req_blocks, request.block_hashes,
                                                  num_cached, num_full)
            else:
                for g, table in enumerate(self.tables):
                    self.block_pool.cache_full_blocks(table[request.request_id],
                                                      request.block_hashes, num_cached,
                                                      num_full, g)
            self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Drops the request's references in every group. Its last blocks are evicted
        first."""
        req_id = request.request_id
        self._num_cached_blocks.pop(req_id, None)
        if self._plain:
            self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(req_id, [])))
            return
        for table, skipped in zip(self.tables, self._num_skipped, strict=True):
            skipped.pop(req_id, None)
            self.block_pool.free_blocks(reversed(table.pop(req_id, [])))

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Real (non-null) blocks the request holds in each group."""
        return [sum(not b.is_null for b in table.get(request_id, ())) for table in self.tables]

    def block_state(self, request_id: str) -> tuple[int, int]:
        """(blocks held, of which registered in the prefix cache) for one request."""
        return (len(self.req_to_blocks.get(request_id, ())),
                self._num_cached_blocks.get(request_id, 0))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The ids of every group's table, one run per group."""
        if self._plain:
            return [b.block_id for b in self.req_to_blocks.get(request_id, [])]
        return [b.block_id for table in self.tables for b in table.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
