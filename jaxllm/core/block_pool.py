"""Physical KV blocks: ref counts, the LRU free queue and the prefix-cache hash map.

Every block except the null block 0 is in exactly one state:
- owned: ref_cnt > 0, held by one or more requests, not in the free queue;
- free: ref_cnt == 0, in the free queue, no hash;
- cached-free: ref_cnt == 0, in the free queue, still findable by its hash
  until it is evicted for reuse (or taken back by a prefix-cache hit).
Block 0 is never handed out: padded tokens write their KV there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from jaxllm.core.block_hash import BlockHash

NULL_BLOCK_ID = 0


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """A block's prefix-cache key in KV cache group `group` (jaxllm/kv_groups.py): the
    same tokens are another block in each group."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; None while the block is not in it.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; the head is evicted first.

    A list with sentinels gives O(1) removal from the middle, which a prefix-
    cache hit on a cached-free block needs (a deque would be O(n)).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise IndexError(f"asked for {n} free blocks, {self.num_free_blocks} exist")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head (next evicted) to tail."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """Hands out blocks, takes them back, and remembers full blocks by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Free plus cached-free blocks: all that a request could be handed."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes `num_blocks` from the head of the free queue, evicting their hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, "
                             f"{self.get_num_free_blocks()} are free")
        queue = self.free_block_queue
        blocks = [queue.popleft()] if num_blocks == 1 else queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int,
                          group: int = 0) -> None:
        """Registers blocks[num_cached_blocks:num_full_blocks] under their hashes (their
        `group_key`s in KV cache group `group`).

        A block whose content is already cached in another block stays
        unregistered: one hash maps to one block, and the duplicate is simply
        reused as a plain block once freed.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue  # a prefix-cache hit, registered already
            block_hash = block_hashes[i] if group == 0 else group_key(block_hashes[i], group)
            if block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block; blocks reaching zero join the queue tail.

        Pass the blocks in eviction order: the first listed is evicted first.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every hash; refused (False) while any block is owned."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True
