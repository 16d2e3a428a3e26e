"""The gateway replica's feed of every engine's KV events into its index (the I/O shell
around gateway.engines.kv_index).

Every replica subscribes to every engine itself - a ZMQ SUB socket per engine that
registers ``kv_events`` - so the index costs no Redis round trip and no replica waits on
another. The engines followed are the pool's (gateway.engines.pool): one that appears
is subscribed to, one that leaves is unsubscribed from and forgotten.

Order is vLLM's publisher's: each batch carries a sequence number, from 0, one more per
batch (vllm/distributed/kv_events.py ``ZmqEventPublisher``), and its ROUTER socket
replays the batches it still buffers from a requested seq on. So:

* on subscribing (a new engine, or this replica just started), the SUB socket connects
  first and then the replay is asked from seq 0 - everything the engine buffers - and
  what the SUB socket queued meanwhile is skipped up to the replay's last seq;
* a gap (a seq past the next one: ZMQ's PUB drops messages for a slow subscriber, past
  its high-water mark) is filled by a replay from the first missing seq; where the
  engine no longer buffers it, or does not answer, the engine's view is dropped and
  rebuilt from what comes after;
* a seq that goes back means the engine's publisher restarted (a new process, its
  cache empty): the view is dropped and the new stream caught up from 0;
* a publisher gone silent while its engine works (requests running at every scrape for
  ``silent_s``, yet no batch: an engine fills blocks, so publishes, whenever it runs
  requests) ages out: its view is dropped and the engine subscribed to afresh, as on
  appearing; until a batch comes, nothing is matched against it.

Dynamo's KV router (lib/llm/src/kv_router/subscriber.rs) and llm-d's kv-cache-manager
(pkg/kvcache/kvevents/pool.go) subscribe the same way, per engine, to vLLM's ZMQ
publisher. A frame that does not decode - a wrong frame count or seq, a payload that is
not vLLM's msgpack - is counted (``ampd_kv_events_malformed``) and skipped; it never
ends the feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import Counter

from gateway.engines.kv_index import Hashing, KVIndex
from gateway.metrics import Family
from surface import kv_events as wire
from surface.registry import WorkerInfo

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0  # an engine's replay answer, whole; past it the view is rebuilt from the live stream
SILENT_S = 30.0  # an engine running requests this long without publishing a batch: its publisher is gone
SEQ_BYTES = 8

Placement = Literal["apply", "skip", "gap", "restart"]


def indexable(info: WorkerInfo) -> bool:
    """An engine whose events can be matched to a prompt: it publishes them, and hashes
    its blocks with the hash surface.kv_events reproduces."""
    return bool(info.kv_events) and info.kv_hash_algo == wire.HASH_ALGO


@dataclass
class SeqOrder:
    """Where one engine's stream stands: the last seq applied (None: nothing yet), and
    the first seq the last replay covered (a seq below it going back means a restart)."""

    last: int | None = None
    floor: int = 0

    @property
    def next(self) -> int:
        return 0 if self.last is None else self.last + 1

    def place(self, seq: int) -> Placement:
        if self.last is None or seq == self.last + 1:
            return "apply"
        if seq > self.last:
            return "gap"
        return "skip" if seq >= self.floor else "restart"


def read(frames: list[bytes]) -> tuple[int, wire.KVEventBatch] | None:
    """A published message's (seq, batch); None for one that is not vLLM's (a replay's
    end frame included, which has no place in the live stream)."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        return None
    try:
        return wire.read_frames(frames)
    except (msgspec.MsgspecError, ValueError):
        return None


class KVSubscriber:
    """Subscriptions to the pool's engines, feeding ``index``; ``malformed`` counts the
    frames skipped, ``dropped`` the views dropped, by why (gap, restart, bound, silent)."""

    def __init__(self, index: KVIndex, malformed: Counter, dropped: Family, silent_s: float = SILENT_S) -> None:
        self.index, self.malformed, self.dropped, self.silent_s = index, malformed, dropped, silent_s
        self._ctx = zmq.asyncio.Context()
        self._feeds: dict[str, tuple[WorkerInfo, asyncio.Task]] = {}
        self._heard: dict[str, float] = {}  # when each engine's feed last applied a batch (or began)
        self._idle: dict[str, float] = {}  # when each engine was last seen running no request

    # -- following the pool -------------------------------------------------------------
    def follow(self, workers: Iterable[WorkerInfo], busy: Collection[str] = ()) -> None:
        """Subscribe to engines that appeared; unsubscribe from and forget those that left
        (or now publish elsewhere: restarted on another port), and those whose publisher
        went silent while they worked (``busy``: the engines running requests now)."""
        now = time.monotonic()
        wanted = {info.worker_id: info for info in workers if indexable(info)}
        for engine, (info, _) in list(self._feeds.items()):
            if engine not in wanted or wanted[engine].kv_events != info.kv_events:
                self._unfollow(engine)
            elif engine not in busy:
                self._idle[engine] = now
            elif now - max(self._heard[engine], self._idle[engine]) > self.silent_s:
                log.warning("KV events of %s: none for %.0f s while it ran requests; subscribing afresh",
                            engine, now - self._heard[engine])  # fmt: skip
                self.dropped.labels("silent").inc()
                self._unfollow(engine)
        for engine, info in wanted.items():
            if engine not in self._feeds:
                self.index.track(engine, info.kv_capacity_tokens)
                self._heard[engine] = self._idle[engine] = now
                self._feeds[engine] = (info, asyncio.create_task(self._feed(info), name=f"kv-events-{engine}"))

    def _unfollow(self, engine: str) -> None:
        self._feeds.pop(engine)[1].cancel()
        self._heard.pop(engine, None)
        self._idle.pop(engine, None)
        self.index.forget(engine)

    def hashing(self, engines: Iterable[str]) -> dict[str, Hashing]:
        """How each of ``engines`` followed, and seen storing a block, hashes a prompt."""
        out = {}
        for engine in engines:
            feed, view = self._feeds.get(engine), self.index.engines.get(engine)
            if feed is not None and view is not None and view.block_size:
                out[engine] = Hashing(feed[0].kv_hash_seed, view.block_size)
        return out

    async def close(self) -> None:
        tasks = [task for _, task in self._feeds.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._feeds.clear()
        self._ctx.destroy(linger=0)

    # -- one engine's feed ----------------------------------------------------------------
    async def _feed(self, info: WorkerInfo) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(info.kv_events)
        order = SeqOrder()
        try:
            await self._catch_up(info, order)
            while True:
                message = self._read(await sub.recv_multipart())
                if message is not None:
                    await self._take(info, order, *message)
        except asyncio.CancelledError:
            raise
        except Exception:  # a fault of the feed's own must not take the gateway down: this engine goes unindexed
            log.exception("KV events of %s: feed stopped", info.worker_id)
            self.index.drop(info.worker_id)
        finally:
            sub.close(linger=0)

    async def _take(self, info: WorkerInfo, order: SeqOrder, seq: int, batch: wire.KVEventBatch) -> None:
        """A live batch, in its place: applied, skipped (a replay had it), or after a
        catch-up (a gap, a restarted publisher)."""
        placement = order.place(seq)
        if placement == "skip":
            return
        if placement == "restart":
            self._drop(info.worker_id, "restart")
            order.last, order.floor = None, 0
            placement = "apply" if seq == 0 else "gap"
        if placement == "gap":
            await self._catch_up(info, order)
            if order.place(seq) == "skip":
                return
            if order.place(seq) == "gap":  # the replay did not reach it: what lies between is lost
                self._drop(info.worker_id, "gap")
        self._apply(info.worker_id, order, seq, batch)

    async def _catch_up(self, info: WorkerInfo, order: SeqOrder) -> None:
        """Apply what the engine buffers from ``order.next`` on; where it no longer holds
        that seq (or does not answer) and the view had one, the view is dropped first."""
        first = order.next
        replayed = await self._replay(info, first)
        if order.last is not None and (replayed is None or (replayed and replayed[0][0] != first)):
            self._drop(info.worker_id, "gap")
        order.floor = first
        for seq, batch in replayed or []:
            if order.place(seq) == "gap":  # a replayed frame was malformed
                self._drop(info.worker_id, "gap")
            if order.place(seq) != "skip":
                self._apply(info.worker_id, order, seq, batch)

    def _apply(self, engine: str, order: SeqOrder, seq: int, batch: wire.KVEventBatch) -> None:
        self._heard[engine] = time.monotonic()
        if not self.index.apply(engine, batch):
            self.dropped.labels("bound").inc()
            log.warning("KV events of %s: more blocks than its KV capacity; view dropped", engine)
        order.last = seq

    def _drop(self, engine: str, reason: str) -> None:
        self.dropped.labels(reason).inc()
        log.info("KV events of %s: view dropped (%s), rebuilt from here on", engine, reason)
        self.index.drop(engine)

    def _read(self, frames: list[bytes]) -> tuple[int, wire.KVEventBatch] | None:
        message = read(frames)
        if message is None:
            self.malformed.inc()
        return message

    async def _replay(self, info: WorkerInfo, first: int) -> list[tuple[int, wire.KVEventBatch]] | None:
        """Every batch the engine buffers from seq ``first`` on (vLLM's replay protocol: the
        answer's frames follow a ``b""`` delimiter, the last one ends with END_SEQ); None
        where it has no replay endpoint or does not answer in time."""
        if not info.kv_events_replay:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(info.kv_events_replay)
        out: list[tuple[int, wire.KVEventBatch]] = []
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                await dealer.send_multipart([b"", wire.seq_bytes(first)])
                while True:
                    frames = (await dealer.recv_multipart())[1:]
                    if len(frames) == 3 and frames[1] == wire.END_SEQ:
                        return out
                    message = self._read(frames)
                    if message is not None:
                        out.append(message)
        except TimeoutError:
            log.info("KV events of %s: no replay from seq %d within %.0f s", info.worker_id, first, REPLAY_TIMEOUT_S)
            return None
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)
