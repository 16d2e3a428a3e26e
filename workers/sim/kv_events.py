"""The GPU-free engine's KV events, published as vLLM 0.32's ``ZmqEventPublisher`` does.

The engine's KV cache records what it stores, evicts and clears (rounds.engine.kv_cache,
hashing blocks with vLLM's own hash: surface.kv_events.BlockHasher); after each step
the engine hands those records here, and they go out as one ``KVEventBatch`` on a PUB
socket, framed ``[topic, seq, payload]``, and into a buffer that a ROUTER socket replays
from a requested seq on (vllm/distributed/kv_events.py: ``_publisher_thread``,
``_service_replay``). The events carry what vLLM's BlockPool puts in them for a model
without LoRA or multi-modal inputs: medium GPU, KV-cache group 0, and the cache salt as
the first block's extra key (``to_event_extra_keys``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from rounds.engine.kv_cache import BlockEvicted, BlocksStored, CacheCleared, KVEvent
from surface import kv_events as wire

log = logging.getLogger(__name__)

BUFFER_STEPS = 10_000  # batches kept for replay: vLLM's KVEventsConfig.buffer_steps


def wire_event(event: KVEvent) -> wire.KVEvent:
    """A recorded event as vLLM's BlockPool would have queued it."""
    if isinstance(event, BlocksStored):
        parent = None if event.parent is None else wire.external_hash(event.parent)
        extra_keys: list[tuple | None] = [None] * len(event.block_hashes)
        if event.cache_salt:
            extra_keys[0] = (event.cache_salt,)
        return wire.BlockStored(
            block_hashes=[wire.external_hash(h) for h in event.block_hashes],
            parent_block_hash=parent,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=None,
            medium=wire.MEDIUM_GPU,
            lora_name=None,
            extra_keys=extra_keys,
            group_idx=0,
        )
    if isinstance(event, BlockEvicted):
        return wire.BlockRemoved(
            block_hashes=[wire.external_hash(event.block_hash)], medium=wire.MEDIUM_GPU, group_idx=0
        )
    assert isinstance(event, CacheCleared)
    return wire.AllBlocksCleared()


class KVEventPublisher:
    """A PUB socket for the batches and a ROUTER socket that replays them, bound on every
    interface at the given ports (0: any free one); ``endpoint`` and ``replay_endpoint``
    say where peers reach them."""

    def __init__(self, advertise_host: str, port: int = 0, replay_port: int = 0, topic: str = "") -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://{advertise_host}:{_bind(self._pub, port)}"
        self.replay_endpoint = f"tcp://{advertise_host}:{_bind(self._replay, replay_port)}"
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._seq = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve_replays(), name="kv-events-replay")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()

    async def publish(self, events: list[KVEvent]) -> None:
        """One step's events as one batch (nothing for a step that recorded none)."""
        if not events:
            return
        batch = wire.KVEventBatch(ts=time.time(), events=[wire_event(e) for e in events], data_parallel_rank=0)
        payload = wire.encode_batch(batch)
        await self._pub.send_multipart(wire.published_frames(self._topic, self._seq, payload))
        self._buffer.append((self._seq, payload))
        self._seq += 1

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV events replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart([client, b"", *wire.published_frames(self._topic, seq, payload)])
            await self._replay.send_multipart([client, b"", b"", wire.END_SEQ, b""])


def _bind(socket: zmq.asyncio.Socket, port: int) -> int:
    if port == 0:
        return socket.bind_to_random_port("tcp://*")
    socket.bind(f"tcp://*:{port}")
    return port
