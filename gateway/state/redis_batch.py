"""Redis commands of concurrent rounds sent together, one pipeline at a time (Nagle's rule).

Each command a round sends alone costs this process a socket write and read, a pooled
connection taken and given back, and a timeout armed, several times what the same
command costs inside a pipeline. With hundreds of rounds in flight the gateway's Redis
commands were a large share of its CPU, four round trips a round
(docs/studies/overhead.md).

So the request path's commands (a round's open, its prefill's enqueue and slot, the
writes that close it) go out as Nagle's algorithm sends segments: a caller that finds
nothing out sends at once, itself, and whatever arrives while something is out waits
and goes as one pipeline as soon as it is back - the busier the gateway, the more each
pipeline carries (ioredis' auto-pipelining, one pipeline at a time). A lone command
costs what it did (a pipeline per command would cost more, and its write would wait
for whatever else the event loop runs first, the round's token count). Each caller gets
its own replies or its own error; its commands stay in order and together. A caller
that stops waiting (a client that hung up) while queued does not take its commands
back: they will be sent.

With one thing out at a time the batch needs one connection and none of redis-py's
command path: what it sends goes over a connection of its own (gateway.state.redis_channel).

Callers that each end with the same ``WAIT`` (gateway.state.failover asks a replica to
acknowledge a round's writes) share one, at the end of the pipeline they go in: a WAIT
blocks the connection until replicas acknowledge everything written before it, or its
timeout, so one answers for all of them - where a WAIT each would, with no replica
answering, hold the connection a timeout per caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import DataError, NoScriptError

from gateway.state.redis_channel import Command, RedisChannel, pack


class PackedConnection(aioredis.Connection):
    """redis-py's asyncio connection, packing commands with hiredis' C packer as its
    synchronous client does (``HiredisRespSerializer``) instead of in Python: the same
    bytes on the wire for a fraction of the CPU. For the
    gateway's commands that do not go through the batch (sessions read, the worker
    registry, statistics read off the request path)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [pack(args)]


class RedisBatch:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.channel = RedisChannel(redis)
        self._queued: list[tuple[list[Command], asyncio.Future[list[Any]]]] = []
        self._out = False  # a command or a pipeline is on its way to Redis
        self._flushing: set[asyncio.Task] = set()

    async def close(self) -> None:
        await self.channel.close()

    async def script(self, script: AsyncScript, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        """``script(keys=keys, args=args)``, with the commands of other rounds waiting to
        go. A script Redis no longer has (it restarted) is loaded and run again on its own."""
        command = (("EVALSHA", script.sha, len(keys), *keys, *args), {})
        (reply,) = await self._send([command])
        if isinstance(reply, NoScriptError):
            return await script(keys=keys, args=args)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def pipeline(self, pipe: aioredis.client.Pipeline) -> list[Any]:
        """The commands staged on ``pipe`` (never executed itself), with the commands of
        other rounds waiting to go; their replies, or the first error, as ``pipe.execute()``
        gives them."""
        commands, pipe.command_stack = list(pipe.command_stack), []
        if not commands:
            return []
        replies = await self._send(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _send(self, commands: list[Command]) -> list[Any]:
        if self._out:
            future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            self._queued.append((commands, future))
            return await future
        self._out = True
        try:
            return await self.channel.send(commands)
        finally:
            self._back()

    def _back(self) -> None:
        """What was out is back: what queued meanwhile goes now, as one pipeline."""
        self._out = False
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        self._out = True
        task = asyncio.get_running_loop().create_task(self._execute(queued))
        self._flushing.add(task)
        task.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task) -> None:
        self._flushing.discard(task)
        self._back()

    async def _execute(self, queued: list[tuple[list[Command], asyncio.Future[list[Any]]]]) -> None:
        try:
            replies = await self._waiting_once([command for commands, _ in queued for command in commands])
        except DataError as exc:
            if len(queued) > 1:
                # A caller's arguments Redis cannot take, found before anything was sent: the
                # others must not fail with it, so each caller's commands go on their own.
                for one in queued:
                    await self._execute([one])
            else:
                _fail(queued, exc)
            return
        except BaseException as exc:  # Redis away, or the gateway stopping: every caller hears it
            _fail(queued, exc)
            if not isinstance(exc, Exception):
                raise
            return
        at = 0
        for commands, future in queued:
            if not future.done():
                future.set_result(replies[at : at + len(commands)])
            at += len(commands)

    async def _waiting_once(self, commands: list[Command]) -> list[Any]:
        """``commands``' replies, the same WAITs among them sent as one, last (see the module docstring)."""
        waits = [i for i, (args, _) in enumerate(commands) if args[0] == "WAIT"]
        if len(waits) < 2 or any(commands[i] != commands[waits[0]] for i in waits):
            return await self.channel.send(commands)
        others = [command for command in commands if command[0][0] != "WAIT"]
        *replies, acknowledged = await self.channel.send([*others, commands[waits[0]]])
        for i in waits:  # ascending: each reply lands where its WAIT was
            replies.insert(i, acknowledged)
        return replies


def _fail(queued: list[tuple[list[Command], asyncio.Future[list[Any]]]], exc: BaseException) -> None:
    for _, future in queued:
        if future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)
