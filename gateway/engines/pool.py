"""The workers a gateway replica can use right now, and how loaded they are.

Refreshed in the background: the registry's live workers plus the statically
configured ones, each scraped (``/metrics``) for KV usage and queue lengths. A worker
that refuses the connection is left out of routing and binding until it answers again;
one that answers too slowly (busy in a long step, a KV handshake, a loaded host) keeps
its last load for a grace (longer while the registry lists it) before it is left out
too. A draining one stays reachable (``get``) for the streams it serves, but is offered
for no new session or round. A worker that vanishes from the registry while it still answers its scrapes
stays for one heartbeat TTL: a Redis restarted empty forgets every worker until their
next beats (gateway.state.outage), while a worker that leaves for good drains first and
stops answering. A worker's engine is asked once what it is (``/version``): for the
GPU-free engine the gateway counts prompts itself (gateway.engines.tokens).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.config import StaticWorker
from gateway.engines.upstream import EngineClient, UpstreamError, WorkerLoad
from gateway.state.outage import REDIS_DOWN, RedisHealth
from gateway.state.role_store import RoleStore
from perfmodel.profile import load_profile
from rounds.binding import Arrivals, DecodeCandidate
from rounds.roles import Assignment
from surface.registry import HEARTBEAT_TTL_S, WorkerInfo, live_workers

log = logging.getLogger(__name__)
# A worker whose scrape times out (an engine busy in a long step, a NIXL handshake, a loaded
# host) keeps its last load this long; one that refuses the connection leaves at once. One
# the registry lists now has its heartbeat to say it lives, and keeps it longer: a niced vLLM
# API server beside engines busy-polling every core has taken over 10 s to answer its scrape,
# and leaving it out then refused its sessions' rounds (503) though it would have served them.
SLOW_SCRAPE_GRACE_S = HEARTBEAT_TTL_S
REGISTERED_SLOW_SCRAPE_GRACE_S = 6 * HEARTBEAT_TTL_S


@dataclass
class LiveWorker:
    info: WorkerInfo
    load: WorkerLoad
    assignment: Assignment | None = None  # its role, where the gateway assigned one (rounds.roles)

    @property
    def binds(self) -> bool:
        """Sessions may be bound to it."""
        return self.info.decodes and (self.assignment is None or self.assignment.binds)

    @property
    def prefills_remote(self) -> bool:
        """Other workers' sessions may prefill on it."""
        return self.info.prefills and (self.assignment is None or self.assignment.prefills_remote)


class WorkerPool:
    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        static: tuple[StaticWorker, ...],
        client: EngineClient,
        health: RedisHealth,
    ) -> None:
        self.redis, self.prefix, self.static, self.client, self.health = redis, prefix, static, client, health
        self.roles = RoleStore(redis, prefix)
        self.workers: dict[str, LiveWorker] = {}
        self._static_infos: dict[str, WorkerInfo] = {}
        self.arrivals = Arrivals()  # bound sessions' KV no scrape shows yet (rounds.binding)
        self._registered_at: dict[str, float] = {}  # when the registry last listed each worker
        self._scraped_at: dict[str, float] = {}  # when each worker last answered a scrape

    async def refresh(self) -> None:
        landed = self.arrivals.scrape_started()
        now = time.monotonic()
        last_view = [w.info for w in self.workers.values() if w.info.worker_id not in self._static_infos]
        try:
            registered = await live_workers(self.redis, self.prefix)
            self.health.answered()
        except REDIS_DOWN as exc:  # keep the last view (gateway.state.outage)
            self.health.failed("registry", exc)
            registered = last_view
        self._registered_at.update((info.worker_id, now) for info in registered)
        listed = {info.worker_id for info in registered}
        recent = [
            info
            for info in last_view
            if info.worker_id not in listed and now - self._registered_at[info.worker_id] < HEARTBEAT_TTL_S
        ]
        infos = registered + recent + await self._static()
        loads = await asyncio.gather(*(self.client.load(i.url) for i in infos), return_exceptions=True)
        assigned = await self._roles([i.worker_id for i in infos if i.role == "both"])
        fresh: dict[str, LiveWorker] = {}
        left: dict[str, str] = {}  # why each worker the pool held drops out of it
        for info, load in zip(infos, loads, strict=True):
            if not isinstance(load, BaseException):
                fresh[info.worker_id] = LiveWorker(info, load, assigned.get(info.worker_id))
                self._scraped_at[info.worker_id] = now
                continue
            log.info("worker %s did not answer its scrape: %r", info.worker_id, load)
            known = self.workers.get(info.worker_id)
            slow = isinstance(load, UpstreamError) and not load.lost
            grace = REGISTERED_SLOW_SCRAPE_GRACE_S if info.worker_id in listed else SLOW_SCRAPE_GRACE_S
            if known is not None and slow and now - self._scraped_at.get(info.worker_id, now) < grace:
                fresh[info.worker_id] = LiveWorker(info, known.load, assigned.get(info.worker_id))  # busy, not gone
            else:
                left[info.worker_id] = f"its scrapes failed ({load!r})"
        self._log_changes(fresh, left)
        self.workers = fresh
        self.arrivals.scraped(landed)

    def _log_changes(self, fresh: dict[str, LiveWorker], left: dict[str, str]) -> None:
        """Workers joining and leaving the pool, each once: an operator's (and a failing
        test's) first question when a request finds no worker is which one left, and why."""
        for worker_id in self.workers.keys() - fresh.keys():
            log.warning("worker %s left the pool: %s", worker_id, left.get(worker_id, "no longer registered"))
        for worker_id in fresh.keys() - self.workers.keys():
            log.warning("worker %s joined the pool (%s)", worker_id, fresh[worker_id].info.url)

    async def _roles(self, worker_ids: list[str]) -> dict:
        """Roles the gateway assigned to engines that can take any (``both``); the last
        known ones while Redis is away."""
        try:
            return await self.roles.load(worker_ids) if worker_ids else {}
        except REDIS_DOWN as exc:
            self.health.failed("roles", exc)
            return {w.info.worker_id: w.assignment for w in self.workers.values() if w.assignment is not None}

    async def _static(self) -> list[WorkerInfo]:
        for spec in self.static:
            if spec.url in self._static_infos:
                continue
            try:
                model = await self.client.model(spec.url)
            except UpstreamError as exc:  # not up yet: try again next refresh
                log.info("static worker %s not answering yet: %r", spec.url, exc)
                continue
            profile = load_profile(spec.profile)
            self._static_infos[spec.url] = WorkerInfo(
                spec.url,
                spec.role,
                spec.url,
                model,
                profile,
                spec.speed,
                profile.kv_capacity_tokens,
                splits=spec.splits,
            )
        return list(self._static_infos.values())

    def role_list(self) -> list[tuple[str, str]]:
        """(worker, role) of every engine in the pool: its assignment, else the role it registered."""
        return [(w.info.worker_id, w.assignment.role if w.assignment is not None else w.info.role)
                for w in self.workers.values()]  # fmt: skip

    def models(self) -> list[str]:
        return sorted({w.info.model for w in self.workers.values()})

    def decoders(self, model: str) -> list[LiveWorker]:
        return [w for w in self.workers.values() if w.info.model == model and w.binds and not w.info.draining]

    def prefillers(self, model: str, exclude: str) -> list[LiveWorker]:
        return [
            w
            for w in self.workers.values()
            if w.info.model == model and w.prefills_remote and not w.info.draining and w.info.worker_id != exclude
        ]

    def get(self, worker_id: str) -> LiveWorker | None:
        return self.workers.get(worker_id)

    def decode_candidates(self, model: str) -> list[DecodeCandidate]:
        """The decode workers taking new rounds, as binding sees them."""
        return [
            DecodeCandidate(
                w.info.worker_id, w.load.kv_usage, w.info.kv_capacity_tokens, self.arrivals.tokens[w.info.worker_id]
            )  # fmt: skip
            for w in self.decoders(model)
        ]

    def forget(self, worker_id: str) -> None:
        """Leave out a worker whose connection just failed, until its next good scrape."""
        self.workers.pop(worker_id, None)
        self.arrivals.forget(worker_id)
