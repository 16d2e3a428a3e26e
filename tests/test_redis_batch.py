"""The request path's Redis commands, batched (gateway.state.redis_batch), against a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import DataError, ResponseError

from ampd.local_redis import free_port, server_binary, start_private_redis
from gateway.state.outage import REDIS_DOWN
from gateway.state.redis_batch import PackedConnection, RedisBatch

REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database

ECHO = "redis.call('INCR', KEYS[1]) return ARGV[1]"
FAILS = "return redis.error_reply('refused ' .. ARGV[1])"


@pytest.fixture
def prefix():
    name = f"batch-{uuid.uuid4().hex[:8]}"
    yield name
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=f"{name}:*"))
    if keys:
        r.delete(*keys)
    r.close()


def test_concurrent_callers_share_pipelines_and_each_gets_its_own_reply(prefix):
    """200 callers at once: each gets its own reply, every command ran once, and the
    commands went out one at a time - the first alone, the rest as one pipeline behind it
    (a pool of one connection was enough: sent one by one, they need a connection each at
    once); a caller whose script fails, or whose arguments cannot be sent, gets its error,
    the others their replies; a caller that stopped waiting while queued does not keep its
    command from running."""

    async def scenario() -> None:
        one = aioredis.ConnectionPool.from_url(
            REDIS_URL, decode_responses=True, max_connections=1, connection_class=PackedConnection
        )
        client = aioredis.Redis(connection_pool=one)
        batch = RedisBatch(client)
        echo, fails = client.register_script(ECHO), client.register_script(FAILS)
        counter = f"{prefix}:n"
        try:
            await echo(keys=[counter], args=["load"])
            replies = await asyncio.gather(*(batch.script(echo, [counter], [f"r{i}"]) for i in range(200)))
            assert replies == [f"r{i}" for i in range(200)]
            assert int(await client.get(counter)) == 201

            calls = [
                batch.script(echo, [counter], ["a"]),
                batch.script(fails, [], ["b"]),
                batch.script(echo, [counter], ["c"]),
            ]
            mixed = await asyncio.gather(*calls, return_exceptions=True)
            assert mixed[0] == "a" and mixed[2] == "c"
            assert isinstance(mixed[1], ResponseError) and "refused b" in str(mixed[1])

            # An argument Redis cannot take (found before sending) fails its caller alone.
            calls = [batch.script(echo, [counter], ["d"]), batch.script(echo, [counter], [None])]
            unsent = await asyncio.gather(*calls, return_exceptions=True)
            assert unsent[0] == "d" and isinstance(unsent[1], DataError), unsent

            first = asyncio.ensure_future(batch.script(echo, [counter], ["first"]))
            await asyncio.sleep(0)  # first is out: what comes next waits for it
            gone = asyncio.ensure_future(batch.script(echo, [counter], ["gone"]))
            await asyncio.sleep(0)
            gone.cancel()
            assert await first == "first"
            assert await batch.script(echo, [counter], ["after"]) == "after"
            assert gone.cancelled() and int(await client.get(counter)) == 201 + 2 + 1 + 3
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_staged_pipeline_goes_with_the_batch_and_fails_as_execute_would(prefix):
    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        batch = RedisBatch(client)
        try:
            pipe = client.pipeline(transaction=False)
            pipe.hset(f"{prefix}:h", mapping={"a": "1", "b": "2"})
            pipe.hgetall(f"{prefix}:h")
            pipe.incr(f"{prefix}:n")
            assert await batch.pipeline(pipe) == [2, {"a": "1", "b": "2"}, 1]
            assert pipe.command_stack == []
            assert await batch.pipeline(client.pipeline(transaction=False)) == []

            bad = client.pipeline(transaction=False)
            bad.incr(f"{prefix}:h")  # a hash: WRONGTYPE
            bad.incr(f"{prefix}:n")
            with pytest.raises(ResponseError, match="WRONGTYPE"):
                await batch.pipeline(bad)
            assert await client.get(f"{prefix}:n") == "2"  # the rest of the batch ran
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_script_redis_forgot_is_loaded_again_and_redis_away_reaches_every_caller(prefix):
    """After SCRIPT FLUSH (a Redis restarted empty) the script is loaded and runs; with
    Redis away every caller of the batch hears it as the gateway's outage errors."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        batch = RedisBatch(client)
        echo = client.register_script(ECHO)
        try:
            await client.script_flush()
            assert await batch.script(echo, [f"{prefix}:n"], ["back"]) == "back"
        finally:
            await client.aclose()

        away = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", decode_responses=True)
        batch = RedisBatch(away)
        echo = away.register_script(ECHO)
        outcomes = await asyncio.gather(*(batch.script(echo, ["k"], [i]) for i in range(5)), return_exceptions=True)
        assert all(isinstance(o, REDIS_DOWN) for o in outcomes), outcomes
        await away.aclose()

    asyncio.run(scenario())


SLOW = """
local start = redis.call('TIME')
repeat local now = redis.call('TIME') until (now[1] - start[1]) * 1000000 + (now[2] - start[2]) > 30000
return ARGV[1]
"""


def test_a_dropped_connection_and_a_caller_that_stops_reading_cost_no_reply(prefix):
    """A connection the batch used, dropped by Redis (as a restart drops it), is opened
    again and the command sent once more, applied once; a caller cancelled while its reply
    is on the way leaves nothing unread for the next caller to take as its own."""

    async def scenario() -> None:
        retry_once = {"retry": Retry(NoBackoff(), 1), "retry_on_error": [aioredis.ConnectionError]}  # the gateway's
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True, **retry_once)
        batch = RedisBatch(client)
        echo, slow = client.register_script(ECHO), client.register_script(SLOW)
        counter = f"{prefix}:n"
        try:
            named = client.pipeline(transaction=False)
            named.client_setname(f"{prefix}-batch")
            named.incr(counter)
            assert await batch.pipeline(named) == [True, 1]
            killer = redis.Redis.from_url(REDIS_URL)
            (mine,) = [c["id"] for c in killer.client_list() if c["name"] == f"{prefix}-batch"]
            assert killer.client_kill_filter(_id=mine)
            killer.close()
            assert await batch.script(echo, [counter], ["after"]) == "after"
            assert int(await client.get(counter)) == 2

            await slow(keys=[], args=["load"])
            stopped = asyncio.ensure_future(batch.script(slow, [], ["stale"]))
            await asyncio.sleep(0.01)  # sent; Redis is still running it
            stopped.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stopped
            assert await batch.script(echo, [counter], ["mine"]) == "mine"
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_callers_waiting_for_a_replica_together_share_one_wait(tmp_path):
    """Six callers at once, each writing and then waiting for a replica (gateway.state.failover),
    on a Redis without one: the first goes alone, the other five queued behind it go as one
    pipeline with one WAIT - so the connection is held two timeouts, not six - and every
    caller gets its own write's reply and the WAIT's."""
    binary = server_binary()
    assert binary is not None, "redis-server is needed (make installs it)"
    server = start_private_redis(binary, free_port(), tmp_path)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        batch = RedisBatch(client)

        async def write(i: int) -> list:
            pipe = client.pipeline(transaction=False)
            pipe.set(f"k{i}", i)
            pipe.wait(1, 300)
            return await batch.pipeline(pipe)

        try:
            await client.config_resetstat()
            assert await asyncio.gather(*(write(i) for i in range(6))) == [[True, 0]] * 6
            assert (await client.info("commandstats"))["cmdstat_wait"]["calls"] == 2
            assert await client.mget([f"k{i}" for i in range(6)]) == [str(i) for i in range(6)]
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


@pytest.mark.unit
def test_commands_are_packed_by_hiredis_into_the_bytes_redis_py_would_send():
    python, packed = aioredis.Connection(), PackedConnection()
    values = ["a", "ünïcode ✓", b"\x00bytes", 0, -1, 2**63, 1.5, -0.0, 1e-300, 0.1 + 0.2, 1e22, 1795670729.7399, ""]
    for value in [*values, "x" * 100_000]:
        command = ("EVALSHA", "f" * 40, 2, "k1", "k2", value)
        assert b"".join(packed.pack_command(*command)) == b"".join(python.pack_command(*command)), value
    assert b"".join(packed.pack_command("CONFIG GET", "maxmemory")) == b"".join(
        python.pack_command("CONFIG GET", "maxmemory")
    )
    for bad in (None, True, [1]):
        with pytest.raises(DataError):
            packed.pack_command("SET", "k", bad)
