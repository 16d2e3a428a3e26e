"""The request path's own connection to Redis (gateway.state.redis_channel), against real Redis
servers: the replies redis-py gives, and the connection opened as redis-py opens it."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError, DataError

from ampd.local_redis import answers, free_port, server_binary, start_private_redis
from gateway.state.redis_channel import Command, RedisChannel

REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database


def commands(prefix: str) -> list[Command]:
    """What the gateway sends and more, each command as redis-py stages it."""
    stage = aioredis.Redis().pipeline(transaction=False)
    stage.set(f"{prefix}:s", "ünïcode ✓")
    stage.get(f"{prefix}:s")
    stage.hset(f"{prefix}:h", mapping={"a": "1", "b": "2"})
    stage.hgetall(f"{prefix}:h")
    stage.hincrby(f"{prefix}:h", "a", 5)
    stage.expire(f"{prefix}:h", 60)
    stage.expire(f"{prefix}:missing", 60)
    stage.zadd(f"{prefix}:z", {"x": 1.5, "y": 2})
    stage.zrange(f"{prefix}:z", 0, -1, withscores=True)
    stage.eval("return {1, 'two', {3, ARGV[1]}, redis.status_reply('FINE')}", 0, "deep")
    stage.eval("return redis.error_reply('refused')", 0)
    stage.incr(f"{prefix}:h")  # a hash: WRONGTYPE
    stage.evalsha("f" * 40, 0)  # NOSCRIPT
    stage.client_setname(f"{prefix}-name")  # a two-word command
    stage.get(f"{prefix}:missing")
    return list(stage.command_stack)


def same(a: object, b: object) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return a == b


@pytest.mark.parametrize("options", ["", "?protocol=2"], ids=["resp3", "resp2"])
@pytest.mark.parametrize("decode", [True, False], ids=["str", "bytes"])
def test_every_reply_is_what_redis_py_gives_for_it(options, decode):
    """The same commands through redis-py's pipeline and through the channel, on keys of
    their own: equal replies, error replies as the same exceptions in the same places."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL + options, decode_responses=decode)
        channel = RedisChannel(client)
        ours, theirs = f"chan-{uuid.uuid4().hex[:8]}", f"chan-{uuid.uuid4().hex[:8]}"
        try:
            pipe = client.pipeline(transaction=False)
            pipe.command_stack = commands(theirs)
            expected = await pipe.execute(raise_on_error=False)
            got = await channel.send(commands(ours))
            expected = [_named(e, theirs, ours) for e in expected]
            assert len(got) == len(expected)
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                assert same(g, e), (i, g, e)
            assert [type(g) for g in got] == [type(e) for e in expected]
        finally:
            await channel.close()
            await client.delete(*[f"{p}:{k}" for p in (ours, theirs) for k in "shz"])
            await client.aclose()

    asyncio.run(scenario())


def _named(value: object, theirs: str, ours: str) -> object:
    """A reply that names redis-py's keys, as it names the channel's."""
    if isinstance(value, str):
        return value.replace(theirs, ours)
    if isinstance(value, bytes):
        return value.replace(theirs.encode(), ours.encode())
    return value


def test_an_argument_that_cannot_be_sent_fails_before_anything_is():
    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        channel = RedisChannel(client)
        key = f"chan-{uuid.uuid4().hex[:8]}:n"
        try:
            with pytest.raises(DataError):
                await channel.send([(("INCR", key), {}), (("SET", key, None), {})])
            assert await client.exists(key) == 0
        finally:
            await channel.close()
            await client.aclose()

    asyncio.run(scenario())


@pytest.fixture
def guarded(tmp_path: Path):
    """A Redis of our own that wants a password, has a second user, and listens on a unix socket too."""
    binary = server_binary()
    assert binary is not None, "redis-server is needed (make installs it)"
    port, socket = free_port(), tmp_path / "redis.sock"
    process = subprocess.Popen(
        [binary[0], "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", str(socket), "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "sesame",
         "--user", "alice", "on", ">wonder", "~*", "&*", "+@all"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not answers(f"redis://:sesame@127.0.0.1:{port}/0"):
        assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield port, socket
    process.kill()
    process.wait()


def test_the_connection_is_opened_as_the_url_says(guarded):
    """A password alone, a user and password, over TCP and a unix socket, either protocol:
    the commands run in the URL's database. A wrong password is the error redis-py raises."""
    port, socket = guarded
    urls = [
        f"redis://:sesame@127.0.0.1:{port}/3",
        f"redis://alice:wonder@127.0.0.1:{port}/4?protocol=2",
        f"redis://:sesame@127.0.0.1:{port}/5?protocol=2",
        f"unix://:sesame@{socket}?db=6",
    ]

    async def scenario() -> None:
        for url in urls:
            client = aioredis.Redis.from_url(url, decode_responses=True)
            channel = RedisChannel(client)
            try:
                assert await channel.send([(("SET", "where", url), {}), (("GET", "where"), {})]) == [True, url]
            finally:
                await channel.close()
                await client.aclose()
        wrong = aioredis.Redis.from_url(f"redis://:open@127.0.0.1:{port}/0")
        channel = RedisChannel(wrong)
        with pytest.raises(AuthenticationError):
            await channel.send([(("PING",), {})])
        await channel.close()
        await wrong.aclose()

    asyncio.run(scenario())
    admin = redis.Redis(host="127.0.0.1", port=port, password="sesame")
    for db, url in zip((3, 4, 5, 6), urls, strict=True):
        admin.execute_command("SELECT", db)
        assert admin.get("where") == url.encode()
    admin.close()


def test_redis_restarted_between_commands_costs_no_command_and_redis_away_is_an_outage(tmp_path):
    """The connection Redis dropped in a restart is opened again at the next command, which
    runs once; with Redis gone, a ``ConnectionError`` (the gateway's outage, gateway.state.outage)."""
    binary = server_binary()
    assert binary is not None
    port = free_port()

    async def scenario() -> None:
        server = start_private_redis(binary, port, tmp_path)
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        channel = RedisChannel(client)
        try:
            assert await channel.send([(("INCR", "n"), {})]) == [1]
            server.process.kill()
            server.process.wait()
            server = start_private_redis(binary, port, tmp_path)  # empty: it keeps nothing on disk
            assert await channel.send([(("INCR", "n"), {})]) == [1]
            server.process.kill()
            server.process.wait()
            with pytest.raises(ConnectionError):
                await channel.send([(("INCR", "n"), {})])
            server = start_private_redis(binary, port, tmp_path)
            await channel.close()  # the gateway stopping: closed for good
            with pytest.raises(ConnectionError, match="closed"):
                await channel.send([(("INCR", "n"), {})])
        finally:
            server.stop()
            await channel.close()
            await client.aclose()

    asyncio.run(scenario())
