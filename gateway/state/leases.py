"""Prefill slots in flight: leases a replica holds while its tasks prefill.

A dispatched task holds one of its worker's slots (``{p}:inflight:{w}``, scored by
lease expiry). The replica running it renews the lease every third of ``LEASE_S`` and
frees the slot when the prefill is over; a replica that crashed renews nothing, so its
slots free themselves when their leases lapse (the queue scripts drop lapsed leases,
gateway.state.scripts). Tasks started while Redis was away (gateway.state.outage) hold no slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio as aioredis

from gateway.state import scripts
from gateway.state.redis_batch import RedisBatch

LEASE_S = 10.0  # a dispatched task's hold on its slot, renewed by its replica while it runs


class Leases:
    def __init__(self, redis: aioredis.Redis, batch: RedisBatch, prefix: str) -> None:
        self.redis, self.batch, self.p = redis, batch, prefix
        self._free = redis.register_script(scripts.FREE)
        self.running: dict[str, str] = {}  # task id -> worker id, for renewal
        self.unqueued: set[str] = set()  # tasks started without Redis: no slot to free

    def key(self, worker_id: str) -> str:
        return f"{self.p}:inflight:{worker_id}"

    def task_key(self, task_id: str) -> str:
        return f"{self.p}:task:{task_id}"

    @staticmethod
    def expiry(now: float) -> float:
        return now + LEASE_S

    def hold(self, task_id: str, worker_id: str) -> None:
        """``task_id`` got a slot of ``worker_id``: renew its lease until it is released."""
        self.running[task_id] = worker_id

    async def free(self, worker_id: str, task_id: str) -> bool:
        """The task's prefill is over: free its slot and forget the task. True if the
        worker's queue holds tasks that may now take the slot."""
        self.running.pop(task_id, None)
        if task_id in self.unqueued:
            self.unqueued.discard(task_id)
            return False
        keys = [self.key(worker_id), self.task_key(task_id), f"{self.p}:pq:{worker_id}"]
        return bool(await self.batch.script(self._free, keys, [task_id]))

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            running = list(self.running.items())
            if not running:
                continue
            with contextlib.suppress(aioredis.RedisError, OSError):  # lapses by itself if Redis stays away
                async with self.redis.pipeline(transaction=False) as pipe:
                    for task_id, worker_id in running:
                        pipe.zadd(self.key(worker_id), {task_id: self.expiry(time.time())}, xx=True)
                    await pipe.execute()
