"""The elastic controller live: rounds.elastic's decisions, on Redis and the worker pool.

One replica at a time - the holder of the leader lease (gateway.state.role_store) - runs the
controller: every ``interval_s`` it reads the engines that can change role (registered
as ``both``) as the controller wants them (role, queued prefill seconds, rounds running,
KV usage, windowed ITL) and writes the moves it returns; every ``forecast_interval_s``
it reads the demand of the interval just ended, which every replica adds its rounds
to. Every replica applies the roles at its next pool refresh. Each model's engines have
their own controller; a role plan applies to each.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from gateway.engines.pool import LiveWorker, WorkerPool
from gateway.metrics import GatewayMetrics
from gateway.state.outage import REDIS_DOWN
from gateway.state.prefill_queue import PrefillQueues
from gateway.state.role_store import RoleStore
from gateway.state.stats import WindowedStats
from perfmodel.slo import SLO
from rounds.core import ITL
from rounds.elastic import Demand, ElasticConfig, ElasticController, EngineState, RolePlan
from rounds.roles import Assignment, Role, busy, initial, move, settle

log = logging.getLogger(__name__)


class DemandLog:
    """The load of each controller interval in Redis, added to by every replica: rounds as
    they arrive (the load offered, which finished rounds understate under overload), and
    their output as they finish."""

    def __init__(self, prefix: str, interval_s: float) -> None:
        self.p, self.interval_s = prefix, interval_s

    def _key(self, now: float) -> str:
        return f"{self.p}:demand:{math.floor(now / self.interval_s)}"

    def _add(self, pipe: aioredis.client.Pipeline, now: float, **counts: int) -> None:
        key = self._key(now)
        for name, value in counts.items():
            pipe.hincrby(key, name, value)
        pipe.expire(key, round(4 * self.interval_s))

    def arrived(self, pipe: aioredis.client.Pipeline, prefill: int, context: int, now: float) -> None:
        self._add(pipe, now, rounds=1, prefill=prefill, context=context)

    def finished(self, pipe: aioredis.client.Pipeline, output: int, now: float) -> None:
        self._add(pipe, now, finished=1, output=output)

    async def last(self, redis: aioredis.Redis, now: float) -> Demand:
        """The demand of the interval that ended last."""
        fields = {k: int(v) for k, v in (await redis.hgetall(self._key(now - self.interval_s))).items()}
        return Demand.of(self.interval_s, **fields)


class ElasticLoop:
    def __init__(
        self,
        config: ElasticConfig,
        pool: WorkerPool,
        queues: PrefillQueues,
        stats: WindowedStats,
        redis: aioredis.Redis,
        prefix: str,
        replica_id: str,
        metrics: GatewayMetrics,
        alpha: float,
        beta: float,
        plan: RolePlan | None = None,
    ) -> None:
        self.config, self.pool, self.queues, self.stats, self.redis = config, pool, queues, stats, redis
        self.roles, self.replica_id, self.metrics = RoleStore(redis, prefix), replica_id, metrics
        self.demand = DemandLog(prefix, config.forecast_interval_s)
        self.alpha, self.beta, self.plan = alpha, beta, plan
        self.controllers: dict[str, ElasticController] = {}

    def controller(self, model: str, slo: SLO) -> ElasticController:
        if model not in self.controllers:
            self.controllers[model] = ElasticController(self.config, slo, self.alpha, self.beta, self.plan)
        return self.controllers[model]

    async def run_forever(self, slo_for: Callable[[str], SLO]) -> None:
        next_forecast = time.time() + self.config.forecast_interval_s
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                if not await self.roles.lead(self.replica_id):
                    continue
                now = time.time()
                forecast = now >= next_forecast
                if forecast:
                    next_forecast = now + self.config.forecast_interval_s
                for model in self.pool.models():
                    await self._step(model, slo_for(model), now, forecast)
            except REDIS_DOWN as exc:  # no shared roles meanwhile: the engines keep theirs
                log.info("elastic controller paused: %r", exc)

    async def _step(self, model: str, slo: SLO, now: float, forecast: bool) -> None:
        workers = [w for w in self.pool.workers.values() if w.info.model == model and w.info.role == "both"]
        if not workers:
            return
        engines = await self.engines(workers)
        controller = self.controller(model, slo)
        if forecast:
            controller.observe(await self.demand.last(self.redis, now), engines)
        for engine in engines:  # transitions whose old work is done
            settled = settle(engine.assignment, _busy(engine))
            if settled != engine.assignment:
                await self.roles.save(settled)
        for chosen in controller.tick(now, engines):
            current = next(e for e in engines if e.worker_id == chosen.worker_id)
            await self.roles.save(move(current.assignment, chosen.role, now, current.assignment.role in _busy(current)))
            self.metrics.role_moves.labels(chosen.reason).inc()
            log.info("engine %s: %s -> %s (%s)", chosen.worker_id, current.assignment.role, chosen.role,
                     chosen.reason)  # fmt: skip

    async def engines(self, workers: list[LiveWorker]) -> list[EngineState]:
        ids = [w.info.worker_id for w in workers]
        read = await self.queues.signals(ids, self.stats, [(ITL, w) for w in ids])
        costs, means = read.queue_costs, read.means
        return [
            EngineState(
                w.assignment or initial(w.info.worker_id, "decode"),
                w.info.profile,
                w.info.speed,
                costs.get(w.info.worker_id, 0.0),
                w.load.running,
                w.load.kv_usage,
                means.get((ITL, w.info.worker_id)),
            )  # fmt: skip
            for w in workers
        ]


def _busy(engine: EngineState) -> set[Role]:
    """What it still runs, as live sees it: prefills queued for it, requests running."""
    return busy(engine.queue_cost_s > 0, engine.decoding > 0)


async def set_role(redis: aioredis.Redis, prefix: str, worker_id: str, role: str) -> Assignment:
    """An operator's move (``ampd workers set``): takes effect at every replica's next refresh."""
    store = RoleStore(redis, prefix)
    current = (await store.load([worker_id])).get(worker_id) or initial(worker_id, "decode")
    moved = move(current, role, time.time(), busy=False)  # type: ignore[arg-type]
    await store.save(moved)
    return moved
