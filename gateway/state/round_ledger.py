"""Rounds in flight per engine, as every gateway replica dispatched them: exact load.

An engine's scraped queue lengths are up to one scrape old (once a second), so sessions
that arrive between two scrapes all see the same engine as the least loaded and pile onto
it. The replicas know better: each round they dispatch is written here when it starts and
struck when it ends, so a round reads what every replica has in flight right now. A round
counts on its decode engine from its start until it closes, and a remote prefill on its
prefill engine until the prefill answers - what the simulator counts as each engine's
running requests (planner.simulator.gateway_side), so live and simulated placement read
one signal (rounds.core.Signals).

``{p}:rounds:{w}`` is a sorted set of entries scored by expiry. The replica renews its
own entries every third of ``ENTRY_S``; a replica that crashed renews nothing, and its
entries stop counting when they lapse (SIGNALS counts unexpired ones only,
gateway.state.scripts). The engines may also serve requests that came by another way;
:func:`foreign` is what a scrape shows beyond the ledger.

One race is left: a round whose ledger read is already on its way to Redis when another
round of this replica writes its entry, and whose read comes back after that write is
acknowledged, misses that round - rounds arriving in the same millisecond may see one
another one short. Closing it needs each read to know which writes Redis took before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Mapping

import redis.asyncio as aioredis

from gateway.state.outage import REDIS_DOWN, RedisHealth
from gateway.state.redis_batch import RedisBatch

ENTRY_S = 30.0  # an entry's life unless its replica renews it
# A round placed by this replica counts here until its entry is written: rounds that arrive
# together read the ledger before any of them has written, and each must see the others.
# One whose round never starts (its client left first) stops counting after this long.
UNWRITTEN_S = 2.0


def key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:rounds:{worker_id}"


def foreign(scraped: Mapping[str, int], before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Requests an engine runs that no gateway replica sent: its scraped requests (running
    and waiting) beyond the ledger's, read once ``before`` and once ``after`` the scrape.
    A round that ended between the first read and the scrape is in ``before`` only, one that
    started in between in ``after`` only; the larger of the two counts both, so a request
    counts as foreign only where it is in neither."""
    return {w: max(0, n - max(before.get(w, 0), after.get(w, 0))) for w, n in scraped.items()}


class RoundLedger:
    """This replica's entries in the ledger: written, renewed and struck; and the rounds it
    has placed whose entries are not written yet. Only a placement by the engines' caches
    reads load in requests (rounds.placement), so a gateway that places otherwise keeps
    no ledger (``enabled`` false) and its rounds pay nothing for it."""

    def __init__(
        self, redis: aioredis.Redis, batch: RedisBatch, prefix: str, health: RedisHealth, enabled: bool = True
    ) -> None:
        self.redis, self.batch, self.p, self.health, self.enabled = redis, batch, prefix, health, enabled
        self.held: set[tuple[str, str]] = set()  # (worker, entry) this replica holds, for renewal
        self._unwritten: dict[tuple[str, str], float] = {}  # (worker, entry) placed, not yet written -> since

    def placed(self, *entries: tuple[str, str]) -> None:
        """Rounds (or remote prefills) placed on these workers: they count from now on."""
        if self.enabled:
            now = time.monotonic()
            self._unwritten.update((entry, now) for entry in entries)

    def unwritten(self) -> Counter[str]:
        """This replica's rounds per worker that a ledger read may not show yet."""
        since = time.monotonic() - UNWRITTEN_S
        for entry in [e for e, placed_at in self._unwritten.items() if placed_at < since]:
            del self._unwritten[entry]
        return Counter(w for w, _ in self._unwritten)

    async def start(self, *entries: tuple[str, str]) -> None:
        """Rounds (or remote prefills) are on these workers from now on: (worker, entry).
        A round cancelled meanwhile (its client left) renews nothing: its entries lapse."""
        if not self.enabled:
            return
        self.held.update(entries)
        expiry = time.time() + ENTRY_S
        try:
            await self._send(*(("ZADD", key(self.p, w), expiry, entry) for w, entry in entries))
        except BaseException:
            self.held.difference_update(entries)
            raise
        finally:
            for entry in entries:
                self._unwritten.pop(entry, None)

    async def end(self, worker_id: str, entry: str) -> None:
        """It is over there: struck at once, so that the next round reads it gone."""
        if (worker_id, entry) in self.held:
            self.held.discard((worker_id, entry))
            await self._send(("ZREM", key(self.p, worker_id), entry))

    async def counts(self, worker_ids: list[str]) -> dict[str, int]:
        """The rounds in flight on each worker, all replicas' (for :func:`foreign`); none
        where no ledger is kept or Redis is away (nothing then counts as foreign)."""
        if not self.enabled or not worker_ids:
            return {}
        now = time.time()
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for w in worker_ids:
                    pipe.zcount(key(self.p, w), now, "+inf")
                return dict(zip(worker_ids, map(int, await pipe.execute()), strict=True))
        except REDIS_DOWN as exc:
            self.health.failed("round ledger", exc)
            return {}

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(ENTRY_S / 3)
            held = list(self.held)
            if not held:
                continue
            with contextlib.suppress(*REDIS_DOWN):  # lapses by itself if Redis stays away
                async with self.redis.pipeline(transaction=False) as pipe:
                    for worker_id, entry in held:
                        pipe.zadd(key(self.p, worker_id), {entry: time.time() + ENTRY_S}, xx=True)
                    await pipe.execute()

    async def _send(self, *commands: tuple[object, ...]) -> None:
        """Writes sent with other rounds' commands: lost, not fatal, while Redis is away (the
        signals then fall back to the profiles alone, gateway.state.outage)."""
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        try:
            await self.batch.pipeline(pipe)
        except REDIS_DOWN as exc:
            self.health.failed("round ledger", exc)
