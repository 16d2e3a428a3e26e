"""Prefill queues in Redis, shared by gateway replicas, and their dispatch.

Every worker has a queue of pending prefill tasks (AMPD, "Efficient Multi-round LLM
Inference over Disaggregated Serving", section 3, step 3) and a number of prefill slots
(gateway.state.leases). Any replica may dispatch any worker's queue, without locks: it peeks
the head window, asks the round core which task runs next (rounds.core: Alg. 2 for
AMPD), and commits the decision with a script that applies it only if the window is
still what it saw and a slot is still free - the reordered window goes back, the chosen
task takes a slot - else it peeks again. The task's owner is then told to run it
(gateway.state.replicas). The scripts and every key are in gateway.state.scripts.

While Redis is away, tasks start unqueued (gateway.state.outage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter

from gateway.state import scripts
from gateway.state.failover import Failover
from gateway.state.leases import Leases
from gateway.state.outage import REDIS_DOWN, RedisHealth
from gateway.state.redis_batch import RedisBatch
from gateway.state.replicas import RECONCILE_S, Dispatched, Replicas
from gateway.state.round_ledger import RoundLedger
from gateway.state.stats import WindowedStats
from rounds.core import RoundCore, Signals
from rounds.reordering import QueuedTask
from rounds.routing import PrefillTask

log = logging.getLogger(__name__)

SWEEP_S = 0.1
LOAD_FIELDS = 5  # what SIGNALS answers per worker (gateway.state.scripts)
MAX_CONFLICTS = 64  # commits lost to concurrent dispatchers before a dispatch call gives up


class QueueFull(Exception):
    pass


class PrefillQueues:
    def __init__(
        self,
        redis: aioredis.Redis,
        batch: RedisBatch,
        prefix: str,
        replica_id: str,
        core: RoundCore,
        *,
        slots: int,
        max_queue: int,
        task_ttl_s: int,
        health: RedisHealth,
        postponements: Counter,
        failover: Failover,
        ledger: bool = True,
    ) -> None:
        self.redis, self.batch, self.p, self.core = redis, batch, prefix, core
        self.failover = failover
        self.postponements = postponements  # Alg. 2 postponements decided by this replica
        self.slots, self.max_queue, self.task_ttl_s, self.health = slots, max_queue, task_ttl_s, health
        self.leases = Leases(redis, batch, prefix)
        self.replicas = Replicas(redis, prefix, replica_id, self.leases, self.release, health)
        self.ledger = RoundLedger(redis, batch, prefix, health, enabled=ledger)
        self._workers: set[str] = set()
        self._active: set[str] = set()  # workers this replica is dispatching right now
        self._dirty: set[str] = set()  # ... and that got new work meanwhile
        self._peek = redis.register_script(scripts.PEEK)
        self._commit = redis.register_script(scripts.COMMIT)
        self._enqueue = redis.register_script(scripts.ENQUEUE)
        self._signals = redis.register_script(scripts.SIGNALS)
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()

    def _q(self, w: str) -> str:
        return f"{self.p}:pq:{w}"

    def _cost(self, w: str) -> str:
        return f"{self.p}:pqcost:{w}"

    def _tokens(self, w: str) -> str:
        return f"{self.p}:pqtokens:{w}"

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        await self.replicas.beat()
        self._tasks = [
            asyncio.create_task(self.replicas.beat_forever(), name="replica-alive"),
            asyncio.create_task(self.replicas.listen_forever(await self.replicas.subscribe()), name="replica-notices"),
            asyncio.create_task(self._sweep(), name="queues-sweep"),
            asyncio.create_task(self.leases.renew_forever(), name="leases-renew"),
            asyncio.create_task(self.ledger.renew_forever(), name="ledger-renew"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def watch(self, worker_ids: Iterable[str]) -> None:
        """The workers whose queues the periodic sweep dispatches."""
        self._workers = set(worker_ids)

    # -- the API the request path uses ---------------------------------------------
    async def signals(
        self, worker_ids: Iterable[str], stats: WindowedStats, wanted: Iterable[tuple[str, str]]
    ) -> Signals:
        """What routing reads, in one round trip: per worker, estimated seconds of prefill
        queued (Eq. 1-2's queue term) and the prompt tokens of the prefills queued or running
        there; and the windowed means ``wanted``. A client's round reads them in the same
        round trip as its session (gateway.state.round_reads)."""
        ids, wanted = list(worker_ids), list(wanted)
        try:
            flat = await self.batch.script(self._signals, (), self.signals_args(ids, stats, wanted))
        except REDIS_DOWN as exc:
            self.health.failed("prefill queue", exc)
            flat = None
        return self.parse_signals(ids, stats, wanted, flat)

    def signals_args(self, ids: list[str], stats: WindowedStats, wanted: list[tuple[str, str]]) -> list[object]:
        """SIGNALS's arguments (gateway.state.scripts)."""
        return [self.p, time.time(), len(ids), *ids, *stats.means_args(wanted)]

    @staticmethod
    def parse_signals(
        ids: list[str], stats: WindowedStats, wanted: list[tuple[str, str]], flat: list | None
    ) -> Signals:
        """SIGNALS's answer, as the round core takes it; ``None`` (Redis is away): no queue to
        wait in, no statistics, so the profiles' estimates alone (gateway.state.outage)."""
        if flat is None:
            return Signals(dict.fromkeys(ids, 0.0), {}, dict.fromkeys(ids, 0))
        costs, tokens, waiting, running = {}, {}, {}, {}
        for i, w in enumerate(ids):
            cost, queued, held, tasks, rounds = flat[LOAD_FIELDS * i : LOAD_FIELDS * (i + 1)]
            costs[w], tokens[w] = max(0.0, float(cost)), int(queued) + int(held)
            waiting[w], running[w] = int(tasks), int(rounds)
        means = stats.parse_means(wanted, flat[LOAD_FIELDS * len(ids) :])
        return Signals(costs, means, tokens, waiting=waiting, running=running)

    async def submit(
        self, worker_id: str, task: PrefillTask, estimate_s: float, ttft_thres_s: float, tokens: int = 0
    ) -> Dispatched:
        """Queue ``task`` on ``worker_id`` and wait until it may run (its slot is then held).
        ``tokens``: the prompt tokens it will compute there (the workers' load signal)."""
        waiting = self.replicas.wait(worker_id, task.task_id)
        now = waiting.enqueued
        fields = {
            "created": repr(task.created_at),
            "enqueued": repr(now),
            "estimate": repr(estimate_s),
            "ttft_thres": repr(ttft_thres_s),
            "postponed": "0",
            "incremental": "1" if task.incremental else "0",
            "owner": self.replicas.replica_id,
            "tokens": str(tokens),
        }
        flat = [x for pair in fields.items() for x in pair]
        keys = [self.leases.task_key(task.task_id), self._q(worker_id), self._cost(worker_id),
                self.leases.key(worker_id), self._tokens(worker_id)]  # fmt: skip
        try:
            try:
                outcome = await self.batch.script(
                    self._enqueue, keys,
                    [task.task_id, self.task_ttl_s, estimate_s, self.max_queue, now, self.slots,
                     self.leases.expiry(now), tokens, *flat],
                )  # fmt: skip
                if outcome == -1:
                    raise QueueFull(f"the prefill queue of {worker_id} is full ({self.max_queue})")
                if outcome == 2:  # straight to a free slot
                    self.leases.hold(task.task_id, worker_id)
                    return Dispatched(worker_id, task.task_id, 0.0)
                await self.dispatch(worker_id)
            except REDIS_DOWN as exc:
                self.health.failed("prefill queue", exc)
                if not waiting.future.done():
                    self.replicas.start_unqueued(task.task_id)
            return await waiting.future
        except BaseException:
            await self._withdraw(worker_id, task.task_id, estimate_s, tokens, waiting.future)
            raise
        finally:
            self.replicas.waiting.pop(task.task_id, None)

    def release(self, worker_id: str, task_id: str) -> None:
        """``finish`` in the background: the request path does not wait for it."""
        self._in_background(self.finish(worker_id, task_id))

    def ledger_end(self, worker_id: str, entry: str) -> None:
        """The ledger's entry struck in the background (gateway.state.round_ledger)."""
        if self.ledger.enabled:
            self._in_background(self.ledger.end(worker_id, entry))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def finish(self, worker_id: str, task_id: str) -> None:
        """The task's prefill is over: free its slot (kept through a failover, gateway.state.failover)
        and start the next one."""
        try:
            if await self.failover.through(partial(self.leases.free, worker_id, task_id), "prefill queue"):
                await self.dispatch(worker_id)
        except REDIS_DOWN as exc:  # the slot's lease lapses by itself
            self.health.failed("prefill queue", exc)

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
        task_prefix = self.leases.task_key("")
        reply = await self.batch.script(
            self._peek, [self.leases.key(worker_id), self._q(worker_id)], [now, self.core.window_size, task_prefix]
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
        decision = self.core.pick(window, now)
        head = decision.order[0]
        chosen, record = ids[head], fields[head]
        args = [now, self.slots, self.leases.expiry(now), chosen, record["estimate"], task_prefix, len(ids), *ids]
        args += [ids[i] for i in decision.order[1:]] + ["|"] + [ids[i] for i in decision.postponed]
        committed = await self.batch.script(
            self._commit,
            [self.leases.key(worker_id), self._q(worker_id), self._cost(worker_id), self._tokens(worker_id)],
            args,
        )
        if int(committed) == 0:
            return None  # the last slot went to someone else
        if int(committed) < 0:
            return False
        self.postponements.inc(len(decision.postponed))
        await self.replicas.notify(record["owner"], Dispatched(worker_id, chosen, now - float(record["enqueued"])))
        return True

    async def _drop_orphans(self, worker_id: str, ids: list[str], fields: list[dict[str, str]]) -> bool:
        """Take tasks whose replica died out of the queue: nobody waits for them, and once
        dispatched they would hold a slot until their lease lapsed. True if any went."""
        dead = await self.replicas.dead(f["owner"] for f in fields)
        orphans = [(i, f) for i, f in zip(ids, fields, strict=True) if f["owner"] in dead]
        if not orphans:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id, record in orphans:
                pipe.lrem(self._q(worker_id), 1, task_id)
                pipe.incrbyfloat(self._cost(worker_id), -float(record["estimate"]))
                pipe.decrby(self._tokens(worker_id), int(record.get("tokens", 0)))
                pipe.delete(self.leases.task_key(task_id))
            await pipe.execute()
        log.info("dropped %d queued prefill tasks of replicas gone: %s", len(orphans), sorted(dead))
        return True

    async def _withdraw(
        self, worker_id: str, task_id: str, estimate_s: float, tokens: int, future: asyncio.Future
    ) -> None:
        """A waiting task's client went away: take the task out of the queue, or out of
        flight if it was dispatched meanwhile."""
        with contextlib.suppress(*REDIS_DOWN):
            removed = await self.redis.lrem(self._q(worker_id), 1, task_id)
            if removed:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.incrbyfloat(self._cost(worker_id), -estimate_s)
                    pipe.decrby(self._tokens(worker_id), tokens)
                    pipe.delete(self.leases.task_key(task_id))
                    await pipe.execute()
            elif future.done() and not future.cancelled():
                await self.finish(worker_id, task_id)

    async def _sweep(self) -> None:
        """Dispatch every known queue now and then: slots freed by other replicas, or by
        leases that lapsed, are taken up even when no local event triggers it. When Redis
        does not answer, this replica's waiting tasks start unqueued: their queue may be
        gone with it. Every RECONCILE_S, waiting tasks are also looked up."""
        sweeps = 0
        while True:
            await asyncio.sleep(SWEEP_S)
            sweeps += 1
            if sweeps % round(RECONCILE_S / SWEEP_S) == 0:
                try:
                    await self.replicas.reconcile()
                except REDIS_DOWN as exc:
                    self.health.failed("prefill queue", exc)
            for worker_id in list(self._workers):
                try:
                    if await self.redis.llen(self._q(worker_id)):
                        await self.dispatch(worker_id)
                except REDIS_DOWN as exc:
                    self.health.failed("prefill queue", exc)
                    self.replicas.start_all_unqueued()
                    break
