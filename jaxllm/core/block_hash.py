"""Chained content hashes of full KV blocks: the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and any extra keys
(e.g. a LoRA id), so two blocks hash equal only when the whole prefix up to and
including them is equal. The digest is SHA-256 over a fixed binary encoding, so
hashes agree across processes and hosts (Python's `hash()` would not).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import msgspec

BlockHash = bytes


class HashedRequest(Protocol):
    """What a block hasher reads and writes of a request (core.request.Request is one;
    named as a protocol because request.py imports this module)."""

    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    hash_root: BlockHash | None  # its first block's parent (None: ROOT_HASH)

    def hashed_by(self, block_hasher: BlockHasher) -> bool: ...

    def hash_new_blocks(self) -> None: ...

# The parent of a request's first block. A constant (not a random seed) keeps
# hashes reproducible across restarts and hosts.
ROOT_HASH: BlockHash = hashlib.sha256(b"jaxllm-prefix-cache-root").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    # The token count is encoded so that token and extra-key bytes never alias.
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys:
        h.update(msgspec.msgpack.encode(extra_keys))
    return h.digest()


def lora_hash_root(lora_int_id: int, lora_name: str) -> BlockHash:
    """The first-block parent of a request running a LoRA adapter."""
    return hash_block_tokens(None, (), ("lora", lora_int_id, lora_name))


def hash_request_tokens(block_size: int, token_ids: Sequence[int],
                        extra_keys: tuple[Any, ...] | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


BlockHasher = Callable[[HashedRequest], list[BlockHash]]


def make_block_hasher(block_size: int) -> BlockHasher:
    """A function giving the hashes of a request's full blocks not hashed yet.

    Requests call it whenever tokens are appended, so hashes are computed once
    per block, as blocks fill up.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")

    def new_block_hashes(request: HashedRequest) -> list[BlockHash]:
        tokens = request.all_token_ids
        done = len(request.block_hashes)
        parent = request.block_hashes[-1] if done else request.hash_root
        new: list[BlockHash] = []
        for start in range(done * block_size, len(tokens) - block_size + 1, block_size):
            parent = hash_block_tokens(parent, tokens[start:start + block_size])
            new.append(parent)
        return new

    def hash_next_block(requests: Iterable[HashedRequest]) -> None:
        """Appends to each request's `block_hashes` the hash of the block its last
        token filled: the decode path, where ~1 request in block_size fills one per
        step. Any other request (hashes lagging further, another hasher) hashes
        itself."""
        for request in requests:
            hashes, tokens = request.block_hashes, request.all_token_ids
            start = len(hashes) * block_size
            if len(tokens) != start + block_size or not request.hashed_by(new_block_hashes):
                request.hash_new_blocks()
                continue
            hashes.append(hash_block_tokens(hashes[-1] if hashes else request.hash_root,
                                            tokens[start:]))

    new_block_hashes.block_size = block_size  # lets requests skip calls that hash nothing
    new_block_hashes.hash_next_block = hash_next_block
    return new_block_hashes
