"""Prefill queues in Redis, shared by gateway replicas, and their dispatcher.

Every worker has a queue of pending prefill tasks (AMPD section 3, step 3) and a
number of prefill slots (tasks in flight). Any replica may dispatch any worker's
queue, without locks: it peeks the head window, asks the policy which task runs next
(gateway.policies.pick: Alg. 2 for AMPD), and commits the decision with a script that
applies it only if the window is still what it saw and a slot is still free - the
reordered window goes back, the chosen task moves to the worker's in-flight set -
else it peeks again. The replica that owns the task (the one holding its client's
connection) is then told to run it.

Keys (``{p}`` is the deployment prefix, ``{w}`` a worker id):

* ``{p}:pq:{w}`` - list of queued task ids, head first
* ``{p}:task:{id}`` - hash: created, enqueued, estimate, ttft_thres, postponed, incremental, owner
* ``{p}:inflight:{w}`` - sorted set of task ids in flight, scored by lease expiry
* ``{p}:pqcost:{w}`` - estimated seconds of prefill queued (Eq. 1-2's queue term)
* ``{p}:ready:{replica}`` - pub/sub channel of each replica

A replica renews the leases of the tasks it runs; a crashed replica's slots free
themselves when the leases lapse. While Redis is away, tasks start unqueued
(gateway.outage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.outage import REDIS_DOWN, RedisHealth
from gateway.policies import Policy, pick
from gateway.reordering import QueuedTask
from gateway.routing import PrefillTask

log = logging.getLogger(__name__)

LEASE_S = 10.0  # a dispatched task's hold on its slot, renewed by its replica while it runs
ALIVE_S = 3.0  # a replica's liveness key lives this long; it is set every ALIVE_S / 3
SWEEP_S = 0.1
RECONCILE_S = 2.0  # how often, and after how long, waiting tasks are looked up in Redis
MAX_CONFLICTS = 64  # commits lost to concurrent dispatchers before a dispatch call gives up

# One round trip: drop lapsed leases, count slots in use, read the head window.
_PEEK = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local busy = redis.call('ZCARD', KEYS[1])
local ids = redis.call('LRANGE', KEYS[2], 0, tonumber(ARGV[2]) - 1)
local out = {busy}
for _, id in ipairs(ids) do
  table.insert(out, id)
  table.insert(out, redis.call('HGETALL', ARGV[3] .. id))
end
return out
"""
# Enqueue a task; if it is alone in the queue and a slot is free, dispatch it at once
# (any policy's choice over a window of one). KEYS: task, queue, cost, inflight. ARGV:
# task id, ttl, estimate, max queue, now, slots, lease end, then field/value pairs.
# Returns -1 (queue full, nothing changed), 1 (queued) or 2 (dispatched).
_ENQUEUE = """
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[4]) then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[5])
if redis.call('LLEN', KEYS[2]) == 0 and redis.call('ZCARD', KEYS[4]) < tonumber(ARGV[6]) then
  redis.call('ZADD', KEYS[4], ARGV[7], ARGV[1])
  return 2
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('INCRBYFLOAT', KEYS[3], ARGV[3])
return 1
"""

# Apply a dispatch decision atomically, if the head window and the free slot it was
# made on still hold. KEYS: inflight, queue, cost. ARGV: now, slots, lease end, chosen,
# its estimate, task key prefix, window size n, the n window ids as seen, then the new
# order of the rest, then "|" and the ids whose postponement counters go up.
_COMMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
local n = tonumber(ARGV[7])
local head = redis.call('LRANGE', KEYS[2], 0, n - 1)
if #head ~= n then return -1 end
for i = 1, n do if head[i] ~= ARGV[7 + i] then return -1 end end
redis.call('LTRIM', KEYS[2], n, -1)
local i = 8 + n
local rest = {}
while ARGV[i] ~= '|' do table.insert(rest, ARGV[i]); i = i + 1 end
for j = #rest, 1, -1 do redis.call('LPUSH', KEYS[2], rest[j]) end
for j = i + 1, #ARGV do redis.call('HINCRBY', ARGV[6] .. ARGV[j], 'postponed', 1) end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('INCRBYFLOAT', KEYS[3], -tonumber(ARGV[5]))
return 1
"""


class QueueFull(Exception):
    pass


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


class PrefillQueues:
    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        replica_id: str,
        policy: Policy,
        window: int,
        slots: int,
        max_queue: int,
        task_ttl_s: int,
        health: RedisHealth,
    ) -> None:
        self.redis, self.p, self.replica_id = redis, prefix, replica_id
        self.policy, self.window, self.slots = policy, window, slots
        self.max_queue, self.task_ttl_s, self.health = max_queue, task_ttl_s, health
        self._waiting: dict[str, Waiting] = {}
        self._running: dict[str, str] = {}  # task id -> worker id, for lease renewal
        self._unqueued: set[str] = set()  # tasks started without Redis: no slot to free
        self._workers: set[str] = set()
        self._active: set[str] = set()  # workers this replica is dispatching right now
        self._dirty: set[str] = set()  # ... and that got new work meanwhile
        self._peek = redis.register_script(_PEEK)
        self._commit = redis.register_script(_COMMIT)
        self._enqueue = redis.register_script(_ENQUEUE)
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.postponements = 0  # Alg. 2 postponements decided by this replica

    # -- keys ----------------------------------------------------------------------
    def _q(self, w: str) -> str:
        return f"{self.p}:pq:{w}"

    def _task(self, task_id: str) -> str:
        return f"{self.p}:task:{task_id}"

    def _inflight(self, w: str) -> str:
        return f"{self.p}:inflight:{w}"

    def _cost(self, w: str) -> str:
        return f"{self.p}:pqcost:{w}"

    def _channel(self, replica: str) -> str:
        return f"{self.p}:ready:{replica}"

    def _alive(self, replica: str) -> str:
        return f"{self.p}:replica:{replica}"

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        with contextlib.suppress(*REDIS_DOWN):
            await self.redis.set(self._alive(self.replica_id), "1", ex=round(ALIVE_S))
        self._tasks = [
            asyncio.create_task(self._beat(), name="queues-alive"),
            asyncio.create_task(self._listen(await self._subscribe()), name="queues-listen"),
            asyncio.create_task(self._sweep(), name="queues-sweep"),
            asyncio.create_task(self._renew(), name="queues-renew"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def watch(self, worker_ids: Iterable[str]) -> None:
        """The workers whose queues the periodic sweep dispatches."""
        self._workers = set(worker_ids)

    # -- the API the request path uses ---------------------------------------------
    async def queue_costs(self, worker_ids: Iterable[str]) -> dict[str, float]:
        ids = list(worker_ids)
        try:
            values = await self.redis.mget([self._cost(w) for w in ids]) if ids else []
        except REDIS_DOWN as exc:  # no queue to wait in: tasks start at once
            self.health.failed("prefill queue", exc)
            values = [None] * len(ids)
        return {w: max(0.0, float(v or 0.0)) for w, v in zip(ids, values, strict=True)}

    async def submit(self, worker_id: str, task: PrefillTask, estimate_s: float, ttft_thres_s: float) -> Dispatched:
        """Queue ``task`` on ``worker_id`` and wait until it may run (its slot is then held)."""
        future: asyncio.Future[Dispatched] = asyncio.get_running_loop().create_future()
        now = time.time()
        self._waiting[task.task_id] = Waiting(worker_id, now, future)
        fields = {
            "created": repr(task.created_at),
            "enqueued": repr(now),
            "estimate": repr(estimate_s),
            "ttft_thres": repr(ttft_thres_s),
            "postponed": "0",
            "incremental": "1" if task.incremental else "0",
            "owner": self.replica_id,
        }
        flat = [x for pair in fields.items() for x in pair]
        keys = [self._task(task.task_id), self._q(worker_id), self._cost(worker_id), self._inflight(worker_id)]
        try:
            try:
                outcome = await self._enqueue(
                    keys=keys,
                    args=[task.task_id, self.task_ttl_s, estimate_s, self.max_queue, now, self.slots, now + LEASE_S,
                          *flat],
                )  # fmt: skip
                if outcome == -1:
                    raise QueueFull(f"the prefill queue of {worker_id} is full ({self.max_queue})")
                if outcome == 2:  # straight to a free slot
                    self._running[task.task_id] = worker_id
                    return Dispatched(worker_id, task.task_id, 0.0)
                await self.dispatch(worker_id)
            except REDIS_DOWN as exc:
                self.health.failed("prefill queue", exc)
                if not future.done():
                    self._start_unqueued(task.task_id)
            return await future
        except BaseException:
            await self._withdraw(worker_id, task.task_id, estimate_s, future)
            raise
        finally:
            self._waiting.pop(task.task_id, None)

    def release(self, worker_id: str, task_id: str) -> None:
        """``finish`` in the background: the request path does not wait for it."""
        self._spawn(self.finish(worker_id, task_id))

    async def finish(self, worker_id: str, task_id: str) -> None:
        """The task's prefill is over: free its slot and start the next one."""
        self._running.pop(task_id, None)
        if task_id in self._unqueued:
            self._unqueued.discard(task_id)
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(self._inflight(worker_id), task_id)
                pipe.delete(self._task(task_id))
                pipe.llen(self._q(worker_id))
                queued = (await pipe.execute())[2]
            if queued:
                await self.dispatch(worker_id)
        except REDIS_DOWN as exc:  # the slot's lease lapses by itself
            self.health.failed("prefill queue", exc)

    def _start_unqueued(self, task_id: str) -> None:
        """Start a waiting task without its queue (Redis is away: gateway.outage)."""
        waiting = self._waiting[task_id]
        self._unqueued.add(task_id)
        waiting.future.set_result(Dispatched(waiting.worker_id, task_id, time.time() - waiting.enqueued))

    # -- dispatch --------------------------------------------------------------------
    async def dispatch(self, worker_id: str) -> None:
        """Start queued tasks on ``worker_id`` while it has free slots.

        Within a replica one coroutine dispatches a worker at a time (others just ask it
        to look again), so hundreds of arrivals do not race each other for one commit;
        across replicas, a lost commit means peeking again.
        """
        if worker_id in self._active:
            self._dirty.add(worker_id)
            return
        self._active.add(worker_id)
        try:
            while True:
                self._dirty.discard(worker_id)
                conflicts = 0
                while conflicts < MAX_CONFLICTS:
                    outcome = await self._dispatch_one(worker_id)
                    if outcome is None:
                        break
                    if not outcome:
                        conflicts += 1
                if worker_id not in self._dirty:
                    return
        finally:
            self._active.discard(worker_id)

    async def _dispatch_one(self, worker_id: str) -> bool | None:
        """True: a task was dispatched; False: the commit lost a race; None: nothing to do."""
        now = time.time()
        reply = await self._peek(
            keys=[self._inflight(worker_id), self._q(worker_id)],
            args=[now, self.policy.window(self.window), f"{self.p}:task:"],
        )
        busy, rest = int(reply[0]), reply[1:]
        if busy >= self.slots or not rest:
            return None
        ids, window, fields = [], [], []
        for task_id, flat in zip(rest[0::2], rest[1::2], strict=True):
            record = dict(zip(flat[0::2], flat[1::2], strict=True))
            if not record:  # withdrawn or expired: drop the stale id
                await self.redis.lrem(self._q(worker_id), 1, task_id)
                return False
            ids.append(task_id)
            fields.append(record)
            window.append(
                QueuedTask(
                    task_id,
                    created_at=float(record["created"]),
                    estimate_s=float(record["estimate"]),
                    ttft_thres_s=float(record["ttft_thres"]),
                    postponed=int(record["postponed"]),
                    incremental=record["incremental"] == "1",
                )
            )
        if await self._drop_orphans(worker_id, ids, fields):
            return False
        decision = pick(self.policy, window, now, self.window)
        head = decision.order[0]
        chosen, record = ids[head], fields[head]
        args = [now, self.slots, now + LEASE_S, chosen, record["estimate"], f"{self.p}:task:", len(ids), *ids]
        args += [ids[i] for i in decision.order[1:]] + ["|"] + [ids[i] for i in decision.postponed]
        committed = await self._commit(
            keys=[self._inflight(worker_id), self._q(worker_id), self._cost(worker_id)], args=args
        )
        if int(committed) == 0:
            return None  # the last slot went to someone else
        if int(committed) < 0:
            return False
        self.postponements += len(decision.postponed)
        done = Dispatched(worker_id, chosen, now - float(record["enqueued"]))
        if record["owner"] == self.replica_id:
            self._hand_over(done)
        else:
            await self.redis.publish(self._channel(record["owner"]), f"{worker_id}|{chosen}|{done.queued_s}")
        return True

    async def _drop_orphans(self, worker_id: str, ids: list[str], fields: list[dict[str, str]]) -> bool:
        """Take tasks whose replica died out of the queue: nobody waits for them, and once
        dispatched they would hold a slot until their lease lapsed. True if any went."""
        owners = sorted({f["owner"] for f in fields} - {self.replica_id})
        if not owners:
            return False
        alive = await self.redis.mget([self._alive(o) for o in owners])
        dead = {o for o, a in zip(owners, alive, strict=True) if a is None}
        orphans = [(i, f) for i, f in zip(ids, fields, strict=True) if f["owner"] in dead]
        if not orphans:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id, record in orphans:
                pipe.lrem(self._q(worker_id), 1, task_id)
                pipe.incrbyfloat(self._cost(worker_id), -float(record["estimate"]))
                pipe.delete(self._task(task_id))
            await pipe.execute()
        log.info("dropped %d queued prefill tasks of replicas gone: %s", len(orphans), sorted(dead))
        return True

    def _hand_over(self, done: Dispatched) -> None:
        if done.task_id in self._running:  # a notice arriving after _reconcile handed it over
            return
        waiting = self._waiting.get(done.task_id)
        if waiting is None or waiting.future.done():  # its client left, or it started unqueued
            self._spawn(self.finish(done.worker_id, done.task_id))
            return
        self._running[done.task_id] = done.worker_id
        waiting.future.set_result(done)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _withdraw(self, worker_id: str, task_id: str, estimate_s: float, future: asyncio.Future) -> None:
        """A waiting task's client went away: take the task out of the queue, or out of
        flight if it was dispatched meanwhile."""
        with contextlib.suppress(*REDIS_DOWN):
            removed = await self.redis.lrem(self._q(worker_id), 1, task_id)
            if removed:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.incrbyfloat(self._cost(worker_id), -estimate_s)
                    pipe.delete(self._task(task_id))
                    await pipe.execute()
            elif future.done() and not future.cancelled():
                await self.finish(worker_id, task_id)

    # -- background ------------------------------------------------------------------
    async def _subscribe(self) -> aioredis.client.PubSub:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self._channel(self.replica_id))
        except REDIS_DOWN as exc:  # listened to again once Redis answers (_listen)
            self.health.failed("dispatch notices", exc)
        return pubsub

    async def _listen(self, pubsub: aioredis.client.PubSub) -> None:
        """Tasks of this replica's that other replicas dispatched. The subscription is made
        again whenever it breaks (a Redis restart forgets it)."""
        while True:
            try:
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    worker_id, task_id, queued = message["data"].split("|")
                    self._hand_over(Dispatched(worker_id, task_id, float(queued)))
            except REDIS_DOWN as exc:
                self.health.failed("dispatch notices", exc)
            await asyncio.sleep(SWEEP_S * 5)
            with contextlib.suppress(*REDIS_DOWN):
                await pubsub.aclose()
            pubsub = await self._subscribe()

    async def _sweep(self) -> None:
        """Dispatch every known queue now and then: slots freed by other replicas, or by
        leases that lapsed, are taken up even when no local event triggers it. When Redis
        does not answer, this replica's waiting tasks start unqueued: their queue may be
        gone with it. Every RECONCILE_S, waiting tasks are also looked up (``_reconcile``)."""
        sweeps = 0
        while True:
            await asyncio.sleep(SWEEP_S)
            sweeps += 1
            if sweeps % round(RECONCILE_S / SWEEP_S) == 0:
                try:
                    await self._reconcile()
                except REDIS_DOWN as exc:
                    self.health.failed("prefill queue", exc)
            for worker_id in list(self._workers):
                try:
                    if await self.redis.llen(self._q(worker_id)):
                        await self.dispatch(worker_id)
                except REDIS_DOWN as exc:
                    self.health.failed("prefill queue", exc)
                    for task_id, waiting in list(self._waiting.items()):
                        if not waiting.future.done():
                            self._start_unqueued(task_id)
                    break

    async def _reconcile(self) -> None:
        """Waiting tasks whose wake-up cannot come: dispatched by another replica while this
        one was not subscribed (a notice published then is lost), or whose queue entry went
        with a Redis that came back empty. The first are handed over, the second start
        unqueued."""
        now = time.time()
        stale = [(task_id, w) for task_id, w in self._waiting.items()
                 if not w.future.done() and now - w.enqueued > RECONCILE_S]  # fmt: skip
        if not stale:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id, waiting in stale:
                pipe.zscore(self._inflight(waiting.worker_id), task_id)
                pipe.exists(self._task(task_id))
            found = await pipe.execute()
        for (task_id, waiting), lease, exists in zip(stale, found[0::2], found[1::2], strict=True):
            if waiting.future.done():
                continue
            if lease is not None:
                self._hand_over(Dispatched(waiting.worker_id, task_id, now - waiting.enqueued))
            elif not exists:
                self._start_unqueued(task_id)

    async def _beat(self) -> None:
        """Say this replica is alive, so others do not drop its queued tasks as orphans."""
        while True:
            await asyncio.sleep(ALIVE_S / 3)
            with contextlib.suppress(*REDIS_DOWN):
                await self.redis.set(self._alive(self.replica_id), "1", ex=round(ALIVE_S))

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            running = list(self._running.items())
            if not running:
                continue
            with contextlib.suppress(aioredis.RedisError, OSError):
                async with self.redis.pipeline(transaction=False) as pipe:
                    for task_id, worker_id in running:
                        pipe.zadd(self._inflight(worker_id), {task_id: time.time() + LEASE_S}, xx=True)
                    await pipe.execute()
