"""Writes through a failover of a Sentinel-managed Redis.

During an outage the gateway's writes are dropped (gateway.state.outage). A
Sentinel-managed Redis (surface.redis_address) is different: its outage is a failover,
over once the sentinels have promoted a replica, and the data is still there. So with
one, the writes that matter past the moment are sent again, a moment apart, while Redis
does not answer - up to ``wait_s``, which should cover the sentinels'
``down-after-milliseconds`` and an election - and reach the new primary (the channel asks
the sentinels where it is when it reconnects):

* the writes that close a round - its record (``GET /v1/sessions/{id}``) and its session -
  which go out before the client gets the round's last bytes, so that the session's next
  request reads them;
* a finished prefill's release of its slot, which would otherwise hold the slot until its
  lease lapses (gateway.state.leases).

After a switch-over (``SENTINEL FAILOVER``) the old primary takes writes, which its resync
as a replica will discard, until the sentinels demote it - seconds later - and drop its
clients. So every FOLLOW_S the sentinels are asked where the primary is, and the gateway's
connections move to a new one at once.

A write sent again may have been applied once already (the old primary took it and died
before answering): a round's record replaces its earlier self (scripts.RECORD_ROUND keys it
by its request), a session's save sets the same fields and a slot is freed once, so none
is doubled; only the windowed statistics may count a round twice.

A round's closing writes also end with ``WAIT 1 ack_ms``: replication is asynchronous, and
a write the primary took but no replica holds yet would be lost with the primary. A write
no replica acknowledged is sent again while the sentinels say a failover is under way -
one of them is failing the primary over, or they name another primary than the one written
to (a switch-over's old primary takes writes until the sentinels demote it) - up to
``wait_s``. Otherwise it went to a primary without a replica answering (the one that took
over from a primary that died, until a replica joins it): the round closes on the primary
alone, counted in ``ampd_redis_unreplicated_writes_total``, and the rounds after it do not
ask for an acknowledgement - which would only hold them up - but one close every
``PROBE_S`` does, so that a replica that joined is noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.asyncio.sentinel import SentinelConnectionPool

from gateway.state.outage import REDIS_DOWN, RedisHealth
from gateway.state.redis_batch import RedisBatch
from gateway.state.redis_channel import Command
from surface.redis_address import follow_primary

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_S = 0.2  # between tries while a failover runs
FOLLOW_S = 1.0  # how often the sentinels are asked where the primary is
PROBE_S = 10.0  # while no replica acknowledges: how often a close asks again
# What a failover looks like from here: the primary gone (refused, reset, not named by the
# sentinels yet) or a replica still loading. Anything else (a script's error) is not retried.
IN_FAILOVER = (aioredis.ConnectionError, aioredis.TimeoutError, OSError)


class Failover:
    """A replica's writes that a failover must not lose, and its connections' move to a new primary."""

    def __init__(
        self, batch: RedisBatch, health: RedisHealth, unreplicated: Counter, wait_s: float, ack_ms: int
    ) -> None:
        self.managed = batch.channel.managed
        self.batch, self.health, self.unreplicated = batch, health, unreplicated
        self.wait_s, self.ack_ms = (wait_s, ack_ms) if self.managed else (0.0, 0)
        self._unacked_since: float | None = None  # since when replicas have not acknowledged

    async def through(self, send: Callable[[], Awaitable[T]], what: str, deadline: float | None = None) -> T | None:
        """What ``send()`` gives, sent again while a failover runs (until ``deadline``, else
        for ``wait_s``); None once Redis counts as away (gateway.state.outage): with a plain
        Redis, at the first failure."""
        deadline = time.monotonic() + self.wait_s if deadline is None else deadline
        while True:
            try:
                return await send()
            except IN_FAILOVER as exc:
                self.health.failed(what, exc)
            except REDIS_DOWN as exc:
                self.health.failed(what, exc)
                return None
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(RETRY_S)

    async def close(self, pipe: aioredis.client.Pipeline, what: str) -> None:
        """A round's closing writes, staged on ``pipe``: kept through a failover and, with
        a replica answering, acknowledged by one (see the module docstring). A plain Redis
        is sent them once."""
        if not self.managed:
            await self.through(partial(self.batch.pipeline, pipe), what)
            return
        writes, deadline = list(pipe.command_stack), time.monotonic() + self.wait_s
        while True:
            asks = self._asks()  # again on each try: replicas may have stopped acknowledging meanwhile
            staged = writes + ([(("WAIT", 1, self.ack_ms), {})] if asks else [])
            replies = await self.through(partial(self._send, pipe, staged), what, deadline)
            if replies is None:
                return
            if not asks or replies[-1] >= 1:
                self._taken(asks)
                return
            if self._unacked_since is not None or not await self._failing_over(what) or time.monotonic() >= deadline:
                self._unacknowledged()
                return
            await asyncio.sleep(RETRY_S)

    async def follow_forever(self) -> None:
        """Keep to the primary the sentinels name: the channel and the client's pooled
        connections move to a new one within FOLLOW_S of a switch-over, where redis-py
        would move them only once the sentinels demote the old one (surface.redis_address)."""
        while True:
            await asyncio.sleep(FOLLOW_S)
            with contextlib.suppress(*REDIS_DOWN):  # a failover under way: the writes' retries see to it
                primary = await follow_primary(self.batch.redis)
                written = self.batch.channel.connected_to
                if written is not None and written != primary:
                    self.batch.channel.drop("the sentinels name another primary")

    async def _send(self, pipe: aioredis.client.Pipeline, commands: list[Command]) -> list[Any]:
        pipe.command_stack = list(commands)  # what the last try sent went with it
        return await self.batch.pipeline(pipe)

    def _asks(self) -> bool:
        """Whether this close asks a replica to acknowledge it: always, unless replicas have
        stopped doing so - then one close every PROBE_S."""
        if not self.ack_ms:
            return False
        now = time.monotonic()
        if self._unacked_since is None:
            return True
        if now - self._unacked_since < PROBE_S:
            return False
        self._unacked_since = now
        return True

    def _taken(self, asked: bool) -> None:
        """The primary took a close's writes - and a replica acknowledged them, if ``asked``."""
        if not asked:
            if self.ack_ms:
                self.unreplicated.inc()
        elif self._unacked_since is not None:
            log.warning("a Redis replica acknowledges round writes again")
            self._unacked_since = None

    def _unacknowledged(self) -> None:
        self.unreplicated.inc()
        if self._unacked_since is None:
            log.warning("no Redis replica acknowledged a round's writes within %d ms, and no failover is under way: "
                        "rounds close on the primary alone until one does", self.ack_ms)  # fmt: skip
        self._unacked_since = time.monotonic()

    async def _failing_over(self, what: str) -> bool:
        """Whether a sentinel says a failover is under way: it is failing the primary over,
        or it names another primary than the one the writes went to - then the connection
        is dropped, for the next try to reach the new one."""
        pool = cast(SentinelConnectionPool, self.batch.redis.connection_pool)
        written = self.batch.channel.connected_to
        for sentinel in pool.sentinel_manager.sentinels:
            try:
                state = await sentinel.sentinel_master(pool.service_name)
            except REDIS_DOWN as exc:  # another sentinel may answer
                self.health.failed(what, exc)
                continue
            if "failover_in_progress" in state["flags"]:
                return True
            if (state["ip"], int(state["port"])) != written:
                self.batch.channel.drop("the sentinels name another primary")
                return True
        return False
