"""Paged KV cache with prefix caching, modelled on vLLM v1's BlockPool/KVCacheManager.

* The cache is a fixed number of blocks of ``block_size`` tokens (the capacity comes
  from the memory model, planner.memory).
* A full block is identified by a hash chained over its parent's hash and its token
  ids, so equal prefixes share blocks across requests and rounds.
* Blocks nobody references go to the tail of an LRU free queue but keep their hash:
  they can still be hit until a new allocation evicts them from the head. A request's
  blocks are released tail first, so its last blocks are evicted before its prefix.
* At most ``num_tokens - 1`` tokens can be a cache hit: the last prompt token is
  always computed, because its logits produce the first output token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int) -> None:
    """Append the chained hash of every newly *full* block of ``token_ids`` to ``hashes``.

    Python's hash of a tuple of ints is the same in every process (no salt), 64 bits,
    and far cheaper than a cryptographic hash - this runs for every block of every
    request in the simulator too.
    """
    parent = hashes[-1] if hashes else 0
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        hashes.append(parent)


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass
class PrefixCacheStats:
    """Counters behind vLLM's prefix_cache_queries_total / prefix_cache_hits_total (tokens)."""

    queries: int = 0
    hits: int = 0


@dataclass
class KVCache:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    free_queue: OrderedDict[int, None] = field(init=False)  # LRU: evict from the front
    cached: dict[int, int] = field(init=False)  # block hash -> block id
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached = {}

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use; evictable cached blocks count as free (as in vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        limit = (num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in hashes[:limit]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def can_allocate(self, num_new_blocks: int, touched: Sequence[int] = ()) -> bool:
        """Enough free blocks for ``num_new_blocks`` after pinning the ``touched`` hits."""
        pinned_from_free = sum(1 for b in touched if self.blocks[b].ref_cnt == 0)
        return self.num_free_blocks - pinned_from_free >= num_new_blocks

    # -- mutations ---------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take references on cache hits, pulling them out of the free queue."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_cnt == 0:
                del self.free_queue[b]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"KV cache over-committed: want {n}, {self.num_free_blocks} free")
        out: list[int] = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict the stale cache entry
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def cache_full_blocks(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Publish full blocks under their hashes (first writer wins on duplicates)."""
        if not self.enable_prefix_caching:
            return
        for block_id, h in zip(block_ids, hashes, strict=True):
            block = self.blocks[block_id]
            if block.block_hash is None:
                block.block_hash = h
                self.cached.setdefault(h, block_id)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, tail first so a prefix outlives its suffix."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {b}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[b] = None
