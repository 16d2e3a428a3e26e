"""The worker registry in a real Redis: entries, heartbeats, draining, removal."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from pathlib import Path

import redis.asyncio as aioredis

from ampd.local_redis import free_port, server_binary, start_private_redis
from perfmodel.profile import DEFAULT_PROFILE, load_profile
from surface.registry import Registration, WorkerInfo, heartbeat_client, live_workers

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


def test_heartbeats_outlast_a_redis_restart_and_a_stall(tmp_path: Path):
    """A private Redis is killed and started again, empty, on the same port: the next
    scheduled beat (one third of the TTL) lists the worker again over a fresh connection.
    Then Redis is frozen (SIGSTOP): each beat gives up after a quarter of the TTL and is
    tried again a moment later, rather than waiting out redis-py's retries; a worker that
    stops meanwhile gives up its goodbye within the TTL instead of hanging."""
    binary = server_binary()
    assert binary is not None, "the test needs a redis-server of its own to kill"
    port = free_port()
    server = start_private_redis(binary, port, tmp_path)
    info = WorkerInfo("w1", "decode", "http://127.0.0.1:1", "m", load_profile(DEFAULT_PROFILE), 1.0, 4096)
    ttl_s = 3.0
    failures: list[float] = []

    class Failures(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            failures.append(time.monotonic())

    async def scenario() -> tuple[float, float, float]:
        nonlocal server
        redis = heartbeat_client(server.url)
        beat = asyncio.create_task(Registration(redis, "restart", info, ttl_s=ttl_s).run())
        await asyncio.sleep(0.1)
        server.process.kill()
        server.process.wait()
        await asyncio.sleep(0.2)
        server = start_private_redis(binary, port, tmp_path)
        answering = time.monotonic()
        # A socket timeout, so that a reader stuck on the new server fails with its cause.
        async with aioredis.from_url(server.url, decode_responses=True, socket_timeout=5) as reader:
            while not await live_workers(reader, "restart"):
                assert time.monotonic() - answering < 5.0, "the entry never came back"
                await asyncio.sleep(0.02)
        back_after = time.monotonic() - answering
        os.kill(server.process.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        await asyncio.sleep(ttl_s)
        beat.cancel()  # the worker stops while Redis is still frozen: its goodbye gives up
        await asyncio.gather(beat, return_exceptions=True)
        stopped_after = time.monotonic() - frozen - ttl_s
        os.kill(server.process.pid, signal.SIGCONT)
        await redis.aclose()
        return back_after, frozen, stopped_after

    handler = Failures(logging.WARNING)
    logging.getLogger("surface.registry").addHandler(handler)
    try:
        # Bounded, so that a hang (seen once in a full run, never alone) fails with the
        # traceback of the await it hung in rather than pytest-timeout's idle event loop.
        back_after, frozen, stopped_after = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        logging.getLogger("surface.registry").removeHandler(handler)
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
    assert back_after < ttl_s / 3 + 0.5
    during_stall = [t - frozen for t in failures if t > frozen]
    assert len(during_stall) >= 2 and during_stall[0] < ttl_s / 3 + ttl_s / 4 + 0.5, during_stall
    assert stopped_after < ttl_s + 1.0  # the goodbye is bounded by the TTL: the entry lapses by then
