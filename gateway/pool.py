"""The workers a gateway replica can use right now, and how loaded they are.

Refreshed in the background: the registry's live workers plus the statically
configured ones, each scraped (``/metrics``) for KV usage and queue lengths. A worker
that does not answer its scrape is left out of routing and binding until it does; a
draining one stays reachable (``get``) for the streams it serves, but is offered for
no new session or round.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.config import StaticWorker
from gateway.upstream import EngineClient, UpstreamError, WorkerLoad
from planner.profile import load_profile
from workers.registry import WorkerInfo, live_workers

log = logging.getLogger(__name__)


@dataclass
class LiveWorker:
    info: WorkerInfo
    load: WorkerLoad
    pending_tokens: int = 0  # prompt tokens of sessions bound here since the last scrape


class WorkerPool:
    def __init__(
        self, redis: aioredis.Redis, prefix: str, static: tuple[StaticWorker, ...], client: EngineClient
    ) -> None:
        self.redis, self.prefix, self.static, self.client = redis, prefix, static, client
        self.workers: dict[str, LiveWorker] = {}
        self._static_infos: dict[str, WorkerInfo] = {}

    async def refresh(self) -> None:
        try:
            registered = await live_workers(self.redis, self.prefix)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("worker registry unreadable, keeping the last view: %s", exc)
            registered = [w.info for w in self.workers.values() if w.info.worker_id not in self._static_infos]
        infos = registered + await self._static()
        loads = await asyncio.gather(*(self.client.load(i.url) for i in infos), return_exceptions=True)
        fresh: dict[str, LiveWorker] = {}
        for info, load in zip(infos, loads, strict=True):
            if isinstance(load, BaseException):
                log.info("worker %s did not answer its scrape: %r", info.worker_id, load)
                continue
            fresh[info.worker_id] = LiveWorker(info, load)
        self.workers = fresh

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
                spec.url, spec.role, spec.url, model, profile, spec.speed, profile.kv_capacity_tokens
            )
        return list(self._static_infos.values())

    def models(self) -> list[str]:
        return sorted({w.info.model for w in self.workers.values()})

    def decoders(self, model: str) -> list[LiveWorker]:
        return [w for w in self.workers.values() if w.info.model == model and w.info.decodes and not w.info.draining]

    def prefillers(self, model: str, exclude: str) -> list[LiveWorker]:
        return [
            w
            for w in self.workers.values()
            if w.info.model == model and w.info.prefills and not w.info.draining and w.info.worker_id != exclude
        ]

    def get(self, worker_id: str) -> LiveWorker | None:
        return self.workers.get(worker_id)

    def serving(self, worker_id: str) -> LiveWorker | None:
        """The worker if it takes new rounds (live and not draining)."""
        worker = self.workers.get(worker_id)
        return None if worker is None or worker.info.draining else worker
