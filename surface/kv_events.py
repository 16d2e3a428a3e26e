"""vLLM's KV events as vLLM 0.32 sends them, and its prefix-cache block hash.

An engine with KV events on publishes, once per scheduler step that stored or evicted
blocks, a ``KVEventBatch`` of ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``
(vllm/distributed/kv_events.py, built by vllm/v1/core/block_pool.py). A gateway that
keeps an index of which engine holds which block reads them here, from vLLM engines and
from the GPU-free engine alike (workers.sim publishes the same messages).

ampd's environment cannot import vLLM, so the structs are mirrored with msgspec exactly
as vLLM declares them: the batch ``array_like`` ([ts, events, data_parallel_rank]), the
events maps tagged with their class name (``tag=True``: ``{"type": "BlockStored", ...}``),
all with ``omit_defaults``. Unknown map keys are ignored, so fields a later vLLM adds to
an event decode; a change to the batch's shape does not, and tests/test_kv_events.py
checks the mirror against vLLM's own structs in vLLM's environment.

The transport is ``ZmqEventPublisher``'s: a PUB socket sending the frames
``[topic, seq, payload]`` (seq an 8-byte big-endian counter from 0) and a ROUTER socket
answering a replay request - the first wanted seq, 8 bytes big-endian - with every
buffered batch from it on, then an end frame ``[b"", END_SEQ, b""]``.

A block's hash is vLLM's ``hash_block_tokens`` (vllm/v1/core/kv_cache_utils.py) under
0.32's default ``--prefix-caching-hash-algo sha256``: SHA-256 of the pickled tuple
``(parent hash, block token ids, extra keys)``, the first block's parent ``NONE_HASH`` =
SHA-256 of the pickled seed (PYTHONHASHSEED if set, else ``"vllm-none-hash"``:
``resolve_none_hash_seed``), and ``cache_salt`` an extra key of the first block only
(``generate_block_hash_extra_keys``). What events carry is the external form,
``maybe_convert_block_hash``: the digest's low 64 bits as an unsigned int
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

import msgspec

# -- the wire structs (vllm/distributed/kv_events.py) ------------------------------------

MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base event: encoded as a map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    """Full blocks now cached, in prefix order: ``block_hashes[0]`` chains to
    ``parent_block_hash`` (None: the prompt's first block), ``token_ids`` are theirs."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the cache (vLLM sends one event per evicted block)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset (vLLM's ``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One scheduler step's events: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch's payload frame; raises msgspec.ValidationError if vLLM's encoding moved."""
    return _decoder.decode(payload)


# -- the frames (vLLM's ZmqEventPublisher) -------------------------------------------------

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame carries this seq


def seq_bytes(seq: int) -> bytes:
    """A sequence number as a frame: 8 bytes big-endian (also a replay request's body)."""
    return seq.to_bytes(8, "big")


def published_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """What the PUB socket sends, and a replay answer after its ``[client id, b""]`` envelope."""
    return [topic, seq_bytes(seq), payload]


def read_frames(frames: Sequence[bytes]) -> tuple[int, KVEventBatch] | None:
    """(seq, batch) of a published or replayed message; None for a replay's end frame."""
    _, seq, payload = frames
    if seq == END_SEQ:
        return None
    return int.from_bytes(seq, "big"), decode_batch(payload)


# -- block hashes (vllm/v1/core/kv_cache_utils.py) -----------------------------------------

HASH_ALGO = "sha256"  # vLLM 0.32's default --prefix-caching-hash-algo, the one reproduced here
DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED, used when PYTHONHASHSEED is unset
# vllm.utils.hashing.sha256 pickles with pickle.HIGHEST_PROTOCOL, which is 5 on every Python
# vLLM 0.32 runs on (3.10-3.13); pinned so that a gateway's Python cannot change it.
PICKLE_PROTOCOL = 5


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=PICKLE_PROTOCOL)).digest()


def hash_seed(env: dict[str, str]) -> str:
    """The seed a vLLM process with this environment derives NONE_HASH from, for sha256
    (``resolve_none_hash_seed``: PYTHONHASHSEED wins)."""
    return env.get("PYTHONHASHSEED", DEFAULT_SEED)


def external_hash(block_hash: bytes) -> int:
    """The hash events carry for a block: ``maybe_convert_block_hash``'s low 64 bits."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


class BlockHasher:
    """vLLM's chained block hash under one seed: plugged into the GPU-free engine's KV
    cache (rounds.engine.kv_cache's ``BlockHasher``), and what a gateway hashes a
    request's token ids with to look them up in what engines published."""

    def __init__(self, seed: str = DEFAULT_SEED) -> None:
        self.seed = seed
        self.none_hash = _sha256(seed)  # init_none_hash

    def __call__(self, hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> None:
        """Append the hash of every newly full block of ``token_ids`` to ``hashes``
        (``request_block_hasher``: only full blocks, each chained to the one before)."""
        parent = hashes[-1] if hashes else self.none_hash
        for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = _sha256((parent, tuple(token_ids[start : start + block_size]), extra))
            hashes.append(parent)

    def external(self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
        """The hashes an engine's ``BlockStored`` events carry for these tokens' full blocks."""
        hashes: list[bytes] = []
        self(hashes, token_ids, block_size, cache_salt)
        return [external_hash(h) for h in hashes]
