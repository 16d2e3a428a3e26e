"""Serving through a Redis outage.

Redis holds what gateway replicas share: sessions, prefill queues, windowed TTFT/ITL
statistics and the worker registry. When it stops answering, a replica keeps serving
on what it holds itself:

* sessions it served continue from its own copy (gateway.state.sessions), bound to the same
  decode worker; new sessions are bound as usual;
* the worker pool stays as last seen (gateway.engines.pool);
* routing runs on profile estimates alone, without the shared statistics and queue
  lengths (gateway.state.stats, gateway.queues);
* prefill tasks start at once instead of queueing - the queues live in Redis - so
  there is no TTFT-aware reordering meanwhile; tasks that were waiting start too,
  since the queue they waited in may be gone;
* what it would have written (round records, statistics) is dropped.

redis-py reconnects by itself at the next command; workers' heartbeats rebuild the
registry within a beat (surface.registry) and the statistics refill within their
window. /readyz reports the outage, and /metrics counts it (``ampd_redis_up``,
``ampd_redis_errors_total`` by what failed).
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from prometheus_client import Gauge

from gateway.metrics import Family

log = logging.getLogger(__name__)

REDIS_DOWN = (aioredis.RedisError, OSError)


class RedisHealth:
    """Whether Redis answered last, as the metrics show it."""

    def __init__(self, up: Gauge, errors: Family) -> None:
        self.up, self._up, self._errors = True, up, errors
        self._up.set(1)

    def failed(self, what: str, exc: BaseException) -> None:
        self._errors.labels(what).inc()
        if self.up:
            log.warning("Redis is unavailable (%s: %r): serving on this replica's own state", what, exc)
        self.up = False
        self._up.set(0)

    def answered(self) -> None:
        if not self.up:
            log.warning("Redis answers again")
        self.up = True
        self._up.set(1)
