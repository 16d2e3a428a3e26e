"""Which prefix blocks each engine holds, from the engines' own KV events (pure, no I/O).

Every engine publishes, per scheduler step, the blocks it cached and evicted
(surface.kv_events: vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``);
gateway.engines.kv_subscriber feeds them here, one engine at a time, in sequence
order. A request's prompt, hashed as the engine hashes it
(surface.kv_events.BlockHasher), then matches its longest cached prefix on each engine:
the chain of block hashes is read from the first block on and stops at the first block
the engine does not hold, as vLLM's own lookup does
(vllm/v1/core/kv_cache_coordinator.py ``find_longest_cache_hit`` over
``BlockPool.get_cached_block``). A block hash covers its whole prefix (each chains to
its parent's), so a set of hashes per engine is all the index keeps - what Dynamo's
radix tree (lib/kv-router/src/indexer) and llm-d's kv-cache-manager (pkg/kvcache/kvblock
index) keep per pod as well, without the tree, since a chained hash already names its
prefix.

**Bounded.** An engine holds at most its KV capacity in blocks
(``WorkerInfo.kv_capacity_tokens // block_size``), so an engine's set cannot grow past
that: a ``BlockStored`` that would take it past its bound means removals were missed, and
the view is dropped (:meth:`KVIndex.apply` says so) for the subscriber to rebuild. A
block costs the set's slot and the hash's int object (``bench.kv_index`` measures the
bytes per block).

Only what a prefix-cache hit on the engine's GPU can use is kept: ``medium`` GPU (vLLM's
CPU offloading announces its own blocks with another medium) and KV-cache group 0 (a
hybrid model's other groups hash the same tokens for other layers: vllm/v1/core/
block_pool.py ``cache_full_blocks`` sends ``group_idx``). Hashes sent as bytes (with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) are folded to the same 64-bit ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from surface.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    external_hash,
)

UNBOUNDED_BLOCKS = 1 << 24  # an engine that registers no KV capacity: a ceiling against a runaway stream


def _int_hash(block_hash: int | bytes) -> int:
    return external_hash(block_hash) if isinstance(block_hash, bytes) else block_hash


def _counts(event: BlockStored | BlockRemoved) -> bool:
    """Whether the event is about the engine's GPU prefix cache (group 0)."""
    return event.medium in (None, MEDIUM_GPU) and event.group_idx in (None, 0)


@dataclass
class EngineBlocks:
    """One engine's view: the hashes of the blocks it holds, and its block size (from its
    first ``BlockStored``; 0 until then)."""

    capacity_tokens: int
    block_size: int = 0
    blocks: set[int] = field(default_factory=set)

    @property
    def max_blocks(self) -> int:
        if self.capacity_tokens <= 0 or self.block_size <= 0:
            return UNBOUNDED_BLOCKS
        return self.capacity_tokens // self.block_size


@dataclass
class KVIndex:
    """Every tracked engine's view, by worker id."""

    engines: dict[str, EngineBlocks] = field(default_factory=dict)

    def track(self, engine: str, capacity_tokens: int) -> None:
        """Start an empty view of ``engine`` (kept as it is if already tracked)."""
        self.engines.setdefault(engine, EngineBlocks(capacity_tokens))

    def forget(self, engine: str) -> None:
        """The engine left: its view goes with it."""
        self.engines.pop(engine, None)

    def drop(self, engine: str) -> None:
        """The view can no longer be trusted (a gap no replay filled): empty, to be rebuilt."""
        view = self.engines.get(engine)
        if view is not None:
            view.blocks = set()

    def apply(self, engine: str, batch: KVEventBatch) -> bool:
        """One batch of ``engine``'s events, in order. False: the view went past the
        engine's bound (its removals were missed) and was dropped."""
        view = self.engines.get(engine)
        if view is None:
            return True
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                view.blocks = set()
            elif isinstance(event, BlockStored):
                if _counts(event):
                    view.block_size = event.block_size
                    view.blocks.update(map(_int_hash, event.block_hashes))
            elif isinstance(event, BlockRemoved) and _counts(event):
                view.blocks.difference_update(map(_int_hash, event.block_hashes))
        if len(view.blocks) > view.max_blocks:
            view.blocks = set()
            return False
        return True

    def held_blocks(self) -> list[tuple[str, int]]:
        """(engine, blocks held) of every tracked engine."""
        return [(engine, len(view.blocks)) for engine, view in self.engines.items()]

    def cached_blocks(self, engine: str, hashes: Sequence[int]) -> int:
        """How many of a request's chained block hashes, from the first, ``engine`` holds."""
        view = self.engines.get(engine)
        if view is None:
            return 0
        for held, block_hash in enumerate(hashes):
            if block_hash not in view.blocks:
                return held
        return len(hashes)


def request_hashes(hasher: BlockHasher, token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[int]:
    """The hashes of the blocks of a prompt an engine could take from its cache: full
    blocks of all but the last token, since vLLM always computes the last one
    (vllm/v1/core/kv_cache_manager.py ``get_computed_blocks``: ``max_cache_hit_length =
    request.num_tokens - 1``)."""
    return hasher.external(token_ids[:-1], block_size, cache_salt)


@dataclass(frozen=True)
class Hashing:
    """How one engine hashes a prompt: its seed (``kv_hash_seed``) and block size."""

    seed: str
    block_size: int


def cached_tokens(
    index: KVIndex, hashing: dict[str, Hashing], token_ids: Sequence[int], cache_salt: str | None
) -> dict[str, int]:
    """The prompt's tokens each engine (of ``hashing``'s) would take from its prefix
    cache now, as the index sees it. Engines hashing alike share one hash chain."""
    chains: dict[Hashing, list[int]] = {}
    out: dict[str, int] = {}
    for engine, how in hashing.items():
        chain = chains.get(how)
        if chain is None:
            chain = chains[how] = request_hashes(BlockHasher(how.seed), token_ids, how.block_size, cache_salt)
        out[engine] = index.cached_blocks(engine, chain) * how.block_size
    return out
