"""Paged KV cache with prefix caching, modelled on vLLM v1's BlockPool/KVCacheManager.

* The cache is a fixed number of blocks of ``block_size`` tokens (the capacity comes
  from the memory model, perfmodel.memory).
* A full block is identified by a hash chained over its parent's hash and its token
  ids, so equal prefixes share blocks across requests and rounds.
* Blocks nobody references go to the tail of an LRU free queue but keep their hash:
  they can still be hit until a new allocation evicts them from the head. A request's
  blocks are released tail first, so its last blocks are evicted before its prefix.
  The queue starts as every block in id order; those never used yet stay at its head as
  a counter, not as entries, because a simulated cluster builds many caches of 10^5
  blocks and most of their blocks are never touched.
* At most ``num_tokens - 1`` tokens can be a cache hit: the last prompt token is
  always computed, because its logits produce the first output token.
* The hash is pluggable (``BlockHasher``): the simulator keeps Python's cheap tuple
  hash, the GPU-free engine plugs in vLLM's own (surface.kv_events.BlockHasher), so the
  hashes it publishes are the ones vLLM publishes for the same tokens.
* With ``record_events``, the cache records what vLLM's BlockPool queues for its KV
  events (vllm/v1/core/block_pool.py): blocks stored when ``cache_full_blocks`` names
  them, one removal per evicted block, a clear on ``reset_prefix_cache``. The caller
  takes them (``take_events``) and publishes them; nothing here does I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

BlockHash = Hashable  # an int under the cheap hash, vLLM's 32-byte digest under its own


class BlockHasher(Protocol):
    def __call__(self, hashes: list, token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> None:
        """Append the chained hash of every newly *full* block of ``token_ids`` to ``hashes``."""


def salt_hash(cache_salt: str | None) -> int:
    """The parent hash of a request's first block: 0 unsalted, else a digest of the salt
    (vLLM folds ``cache_salt`` into the first block's hash), the same in every process."""
    if cache_salt is None:
        return 0
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "big", signed=True)


def extend_block_hashes(hashes: list, token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> None:
    """Append the chained hash of every newly *full* block of ``token_ids`` to ``hashes``,
    the first chained to ``salt_hash(cache_salt)``: the default ``BlockHasher``.

    Python's hash of a tuple of ints is the same in every process (no salt), 64 bits,
    and far cheaper than a cryptographic hash - this runs for every block of every
    request in the simulator too.
    """
    parent = hashes[-1] if hashes else salt_hash(cache_salt)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        hashes.append(parent)


@dataclass
class PrefixCacheStats:
    """Counters behind vLLM's prefix_cache_queries_total / prefix_cache_hits_total (tokens)."""

    queries: int = 0
    hits: int = 0


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Full blocks cached, in prefix order (vLLM's ``BlockStored``): ``parent`` is the
    hash of the block before the first (None: the first is the prompt's first block)."""

    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    cache_salt: str | None  # an extra key of the prompt's first block (vLLM's extra_keys)


@dataclass(frozen=True, slots=True)
class BlockEvicted:
    """A cached block's hash dropped to reuse the block (vLLM's ``BlockRemoved``)."""

    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Every hash dropped (vLLM's ``AllBlocksCleared``)."""


KVEvent = BlocksStored | BlockEvicted | CacheCleared


@dataclass
class KVCache:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    hasher: BlockHasher = extend_block_hashes
    record_events: bool = False
    # Per block, indexed by block id: plain lists, as every hit, allocation and free walks them.
    ref_cnt: list[int] = field(init=False)
    block_hash: list[BlockHash | None] = field(init=False)
    # The LRU free queue (evict from the front): blocks ``unused..num_blocks-1``, never
    # used, then the freed ones in the order they were freed.
    unused: int = field(init=False)
    freed: OrderedDict[int, None] = field(init=False)
    cached: dict[BlockHash, int] = field(init=False)  # block hash -> block id
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    events: list[KVEvent] = field(default_factory=list)  # recorded since the last take_events

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.ref_cnt = [0] * self.num_blocks
        self.block_hash = [None] * self.num_blocks
        self.unused = 0
        self.freed = OrderedDict()
        self.cached = {}

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.unused + len(self.freed)

    def free_queue(self) -> list[int]:
        """The free blocks, next to be evicted first."""
        return [*range(self.unused, self.num_blocks), *self.freed]

    @property
    def usage(self) -> float:
        """Fraction of blocks in use; evictable cached blocks count as free (as in vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_blocks(self, hashes: list, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Extend a request's ``hashes`` over its newly full blocks with this cache's hasher."""
        self.hasher(hashes, token_ids, self.block_size, cache_salt)

    def find_cached_prefix(self, hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        limit = (num_tokens - 1) // self.block_size
        found = list(map(self.cached.get, hashes[:limit]))  # one C-level pass; cut at the first miss
        return found[: found.index(None)] if None in found else found

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def can_allocate(self, num_new_blocks: int, touched: Sequence[int] = ()) -> bool:
        """Enough free blocks for ``num_new_blocks`` after pinning the ``touched`` hits."""
        free = self.num_blocks - self.unused + len(self.freed)  # num_free_blocks, inlined: called per request per step
        if free - len(touched) >= num_new_blocks:  # enough even if every hit comes out of the free queue
            return True
        ref_cnt = self.ref_cnt
        pinned_from_free = sum(1 for b in touched if ref_cnt[b] == 0)
        return free - pinned_from_free >= num_new_blocks

    # -- mutations ---------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take references on cache hits, pulling them out of the free queue (a hit was
        used before, so it is among the freed)."""
        ref_cnt, freed = self.ref_cnt, self.freed
        for b in block_ids:
            if ref_cnt[b] == 0:
                del freed[b]
            ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"KV cache over-committed: want {n}, {self.num_free_blocks} free")
        ref_cnt = self.ref_cnt
        fresh = min(n, self.num_blocks - self.unused)  # the head of the queue: never used, no hash
        out = list(range(self.unused, self.unused + fresh))
        self.unused += fresh
        if n > fresh:  # then the freed, oldest first, each evicting its stale cache entry
            popitem, block_hash, cached = self.freed.popitem, self.block_hash, self.cached
            reused = [popitem(False)[0] for _ in range(n - fresh)]
            for block_id in reused:
                h = block_hash[block_id]
                if h is not None:
                    if cached.get(h) == block_id:
                        del cached[h]
                    block_hash[block_id] = None
                    if self.record_events:  # vLLM removes a duplicate's hash too, and says so
                        self.events.append(BlockEvicted(h))
            out += reused
        for block_id in out:
            ref_cnt[block_id] = 1
        return out

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        """Publish a request's full blocks ``start..end-1`` under their hashes (first writer
        wins on duplicates); ``token_ids`` and ``cache_salt`` are the request's, for the event."""
        if not self.enable_prefix_caching:
            return
        block_hash, cached = self.block_hash, self.cached
        for block_id, h in zip(block_ids[start:end], hashes[start:end], strict=True):
            if block_hash[block_id] is None:
                block_hash[block_id] = h
                cached.setdefault(h, block_id)
        if self.record_events:
            size = self.block_size
            parent = hashes[start - 1] if start else None
            salt = cache_salt if start == 0 else None
            self.events.append(
                BlocksStored(list(hashes[start:end]), parent, list(token_ids[start * size : end * size]), size, salt)
            )

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, as vLLM's ``reset_prefix_cache``: only while no block is in use."""
        if any(self.ref_cnt):
            return False
        self.block_hash = [None] * self.num_blocks
        self.cached = {}
        if self.record_events:
            self.events.append(CacheCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call (vLLM's ``BlockPool.take_events``)."""
        events, self.events = self.events, []
        return events

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, tail first so a prefix outlives its suffix."""
        ref_cnt, freed = self.ref_cnt, self.freed
        for b in reversed(block_ids):
            count = ref_cnt[b] - 1
            if count < 0:
                raise RuntimeError(f"double free of block {b}")
            ref_cnt[b] = count
            if count == 0:
                freed[b] = None
