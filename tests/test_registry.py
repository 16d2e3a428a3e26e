"""The worker registry in a real Redis: entries, heartbeats, draining, removal."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from planner.profile import DEFAULT_PROFILE, load_profile
from workers.registry import Registration, WorkerInfo, live_workers

REDIS_URL = "redis://127.0.0.1:6379/13"


def test_a_draining_worker_stays_listed_and_says_so_until_it_leaves():
    async def scenario() -> list[list[tuple[str, bool]]]:
        redis = aioredis.from_url(REDIS_URL, decode_responses=True)
        prefix = f"reg-{uuid.uuid4().hex[:8]}"
        info = WorkerInfo("w1", "decode", "http://127.0.0.1:1", "m", load_profile(DEFAULT_PROFILE), 1.0, 4096)
        registration = Registration(redis, prefix, info, ttl_s=3.0)
        seen = []

        async def look() -> None:
            seen.append([(w.worker_id, w.draining) for w in await live_workers(redis, prefix)])

        beat = asyncio.create_task(registration.run())
        await asyncio.sleep(0.05)
        await look()
        await registration.drain()
        await look()
        await asyncio.sleep(1.5)  # beats after the drain keep the mark (and the entry alive past its TTL)
        await look()
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await look()
        await redis.aclose()
        return seen

    assert asyncio.run(scenario()) == [[("w1", False)], [("w1", True)], [("w1", True)], []]
