"""Gateway replicas: which are alive, and the hand-over of dispatched tasks to their owners.

Any replica may dispatch any worker's prefill queue (gateway.state.prefill_queue), but only
the replica holding a task's client connection - its owner - can run it. This replica
waits on a future per queued task of its own; a dispatch it makes itself resolves the
future at once, one made elsewhere reaches it as a notice on its pub/sub channel. A
notice published while this replica was not subscribed (Redis dropped the
subscription) is lost, so waiting tasks are also looked up now and then
(:meth:`Replicas.reconcile`). Each replica says it is alive every third of ``ALIVE_S``;
queued tasks of a replica that stopped saying so are orphans (nobody waits for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.state.leases import Leases
from gateway.state.outage import REDIS_DOWN, RedisHealth

ALIVE_S = 3.0  # a replica's liveness key lives this long; it is set every ALIVE_S / 3
RECONCILE_S = 2.0  # how often, and after how long, waiting tasks are looked up in Redis
RESUBSCRIBE_S = 0.5


@dataclass(frozen=True)
class Dispatched:
    worker_id: str
    task_id: str
    queued_s: float  # time from enqueue to dispatch


@dataclass(frozen=True)
class Waiting:
    """A task of this replica's, queued, and the future its round waits on."""

    worker_id: str
    enqueued: float
    future: asyncio.Future[Dispatched]


class Replicas:
    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        replica_id: str,
        leases: Leases,
        release: Callable[[str, str], None],
        health: RedisHealth,
    ) -> None:
        self.redis, self.p, self.replica_id = redis, prefix, replica_id
        self.leases, self.release, self.health = leases, release, health
        self.waiting: dict[str, Waiting] = {}

    def _alive(self, replica: str) -> str:
        return f"{self.p}:replica:{replica}"

    def _channel(self, replica: str) -> str:
        return f"{self.p}:ready:{replica}"

    # -- liveness -----------------------------------------------------------------------
    async def beat(self) -> None:
        with contextlib.suppress(*REDIS_DOWN):
            await self.redis.set(self._alive(self.replica_id), "1", ex=round(ALIVE_S))

    async def beat_forever(self) -> None:
        """Say this replica is alive, so others do not drop its queued tasks as orphans."""
        while True:
            await asyncio.sleep(ALIVE_S / 3)
            await self.beat()

    async def dead(self, owners: Iterable[str]) -> set[str]:
        """Of these replicas, the ones no longer alive."""
        others = sorted(set(owners) - {self.replica_id})
        if not others:
            return set()
        alive = await self.redis.mget([self._alive(o) for o in others])
        return {o for o, a in zip(others, alive, strict=True) if a is None}

    # -- waiting tasks and their hand-over ----------------------------------------------
    def wait(self, worker_id: str, task_id: str) -> Waiting:
        future: asyncio.Future[Dispatched] = asyncio.get_running_loop().create_future()
        self.waiting[task_id] = Waiting(worker_id, time.time(), future)
        return self.waiting[task_id]

    async def notify(self, owner: str, done: Dispatched) -> None:
        """Tell the task's owner it may run (itself at once)."""
        if owner == self.replica_id:
            self.hand_over(done)
        else:
            await self.redis.publish(self._channel(owner), f"{done.worker_id}|{done.task_id}|{done.queued_s}")

    def hand_over(self, done: Dispatched) -> None:
        if done.task_id in self.leases.running:  # a notice arriving after reconcile() handed it over
            return
        waiting = self.waiting.get(done.task_id)
        if waiting is None or waiting.future.done():  # its client left, or it started unqueued
            self.release(done.worker_id, done.task_id)
            return
        self.leases.hold(done.task_id, done.worker_id)
        waiting.future.set_result(done)

    def start_unqueued(self, task_id: str) -> None:
        """Start a waiting task without its queue (Redis is away: gateway.state.outage)."""
        waiting = self.waiting[task_id]
        self.leases.unqueued.add(task_id)
        waiting.future.set_result(Dispatched(waiting.worker_id, task_id, time.time() - waiting.enqueued))

    def start_all_unqueued(self) -> None:
        for task_id, waiting in list(self.waiting.items()):
            if not waiting.future.done():
                self.start_unqueued(task_id)

    async def listen_forever(self, pubsub: aioredis.client.PubSub) -> None:
        """Tasks of this replica's that other replicas dispatched, on ``pubsub`` (made by
        ``subscribe`` before any task is queued). The subscription is made again whenever
        it breaks (a Redis restart forgets it)."""
        while True:
            try:
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    worker_id, task_id, queued = message["data"].split("|")
                    self.hand_over(Dispatched(worker_id, task_id, float(queued)))
            except REDIS_DOWN as exc:
                self.health.failed("dispatch notices", exc)
            await asyncio.sleep(RESUBSCRIBE_S)
            with contextlib.suppress(*REDIS_DOWN):
                await pubsub.aclose()
            pubsub = await self.subscribe()

    async def subscribe(self) -> aioredis.client.PubSub:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self._channel(self.replica_id))
        except REDIS_DOWN as exc:  # listened to again once Redis answers (listen_forever)
            self.health.failed("dispatch notices", exc)
        return pubsub

    async def reconcile(self) -> None:
        """Waiting tasks whose wake-up cannot come: dispatched by another replica while this
        one was not subscribed (its notice was lost), or whose queue entry went with a
        Redis that came back empty. The first are handed over, the second start unqueued."""
        now = time.time()
        stale = [(task_id, w) for task_id, w in self.waiting.items()
                 if not w.future.done() and now - w.enqueued > RECONCILE_S]  # fmt: skip
        if not stale:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id, waiting in stale:
                pipe.zscore(self.leases.key(waiting.worker_id), task_id)
                pipe.exists(self.leases.task_key(task_id))
            found = await pipe.execute()
        for (task_id, waiting), lease, exists in zip(stale, found[0::2], found[1::2], strict=True):
            if waiting.future.done():
                continue
            if lease is not None:
                self.hand_over(Dispatched(waiting.worker_id, task_id, now - waiting.enqueued))
            elif not exists:
                self.start_unqueued(task_id)
