"""The request path's connection to Redis, spoken without redis-py's command path.

A script call redis-py's asyncio client sends alone cost the gateway a few times the
CPU it costs over this connection: an asyncio protocol that packs with hiredis, parses
replies with hiredis' reader and keeps a queue of futures between the two; inside
pipelines likewise (bench/studies/overhead_hot_path/redis_client.py,
docs/studies/overhead.md). The difference is redis-py's layers
around the socket: a connection taken from the pool
and given back, a retry wrapper, a lock, a timeout armed per read, each reply read by
an awaited call of its own. The batch (gateway.state.redis_batch) sends one thing at a time
and needs none of them, so its commands go over this one connection.

What it keeps of redis-py, because the rest of the gateway and its fault tests rely on it:

* the connection is opened as the client's URL says - host and port, a unix socket or
  TLS, username and password, the database - with redis-py's own parsing of the URL and
  its TLS context; replies are decoded as the client decodes them;
* for a primary Redis Sentinel manages (surface.redis_address), the address is the one
  redis-py's sentinel-managed pool has the sentinels name each time the connection is
  opened, so a connection opened again after a failover reaches the new primary; a
  ``READONLY`` reply there means the primary was demoted under it (a switch-over), and
  counts as a lost connection: a replica applies no write, so sending again is safe;
* a reply is what redis-py gives for it: each command's response callback applied
  (``EXPIRE`` is a bool, ``HGETALL`` a dict), an error reply the exception redis-py
  raises for it (``NoScriptError`` for ``NOSCRIPT``), in its place among the replies;
* a connection that fails (Redis restarted, dropped it, or is away) is opened again and
  the commands sent once more, as the gateway's client retries once
  (gateway.coordinator); a second failure is a ``redis.ConnectionError``, which the
  gateway reads as an outage (gateway.state.outage);
* a caller that stops waiting leaves its replies to be read and dropped, never taken
  by the next caller as its own.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import ConnectionError, DataError, InvalidResponse, ReadOnlyError

Command = tuple[tuple[Any, ...], dict[str, Any]]  # redis-py's staged form: (args, options)


def pack(args: tuple[Any, ...]) -> bytes:
    """One command in RESP, by hiredis' C packer - the bytes redis-py would send (its
    two-word command names, "SCRIPT LOAD", split as it splits them) - or the
    ``DataError`` redis-py raises for an argument it cannot send (None, say)."""
    name = args[0].encode() if isinstance(args[0], str) else args[0]
    if b" " in name:
        args = (*name.split(), *args[1:])
    try:
        return hiredis.pack_command(args)
    except TypeError as exc:
        raise DataError(str(exc)) from exc


class _Replies(asyncio.Protocol):
    """One connection's replies, handed in order to the futures waiting for them."""

    def __init__(self, reader_options: dict[str, Any]) -> None:
        self.reader = hiredis.Reader(protocolError=InvalidResponse, replyError=BaseParser.parse_error, **reader_options)
        self.waiting: deque[tuple[asyncio.Future[list[Any]], int, list[Any]]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                if isinstance(reply, hiredis.PushNotification):  # RESP3's unasked messages: none are subscribed to
                    continue
                future, wanted, replies = self.waiting[0]
                replies.append(reply)
                if len(replies) == wanted:
                    self.waiting.popleft()
                    if not future.done():  # else its caller stopped waiting: the replies are dropped
                        future.set_result(replies)
        except InvalidResponse as exc:  # not Redis's protocol: nothing more on it can be trusted
            self.connection_lost(exc)
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is not None:
            return
        self.lost = ConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}")
        for future, _, _ in self.waiting:
            if not future.done():
                future.set_exception(self.lost)
        self.waiting.clear()

    def send(self, data: bytes, count: int) -> asyncio.Future[list[Any]]:
        assert self.transport is not None
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            future.set_exception(self.lost)
            return future
        self.waiting.append((future, count, []))
        self.transport.write(data)
        return future


class RedisChannel:
    def __init__(self, client: aioredis.Redis) -> None:
        pool = client.connection_pool
        # A connection as redis-py would make it, never opened: what to open and how to speak.
        self._like = pool.connection_class(**pool.connection_kwargs)
        self._callbacks: Mapping[str, Callable[..., Any]] = client.response_callbacks
        encoder = self._like.encoder
        self._reader_options = (
            {"encoding": encoder.encoding, "errors": encoder.encoding_errors} if encoder.decode_responses else {}
        )
        self._replies: _Replies | None = None
        self._connecting: asyncio.Task[_Replies] | None = None
        self._closed = False
        self._address: tuple[str, int] | None = None  # where the open connection goes (TCP)

    async def send(self, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply, or its error reply as an exception, in order; a
        ``DataError`` before anything is sent if an argument cannot be."""
        data = b"".join([pack(args) for args, _ in commands])
        try:
            raw = await self._exchange(data, len(commands))
        except (ConnectionError, OSError):  # opened again, sent once more (see the module docstring)
            try:
                raw = await self._exchange(data, len(commands))
            except OSError as exc:
                raise ConnectionError(f"Redis unreachable: {exc}") from exc
        return [self._parsed(reply, args, options) for reply, (args, options) in zip(raw, commands, strict=True)]

    async def close(self) -> None:
        """Close the connection; what is on its way fails, and nothing opens it again."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._replies is not None and self._replies.transport is not None:
            self._replies.transport.close()
        self._replies = self._connecting = None

    async def _exchange(self, data: bytes, count: int) -> list[Any]:
        if self._closed:
            raise ConnectionError("the gateway's Redis channel is closed")
        replies = self._replies
        if replies is None or replies.lost is not None:
            replies = await self._connected()
        raw = await replies.send(data, count)
        if self.managed and any(isinstance(reply, ReadOnlyError) for reply in raw):
            _drop(replies, ConnectionError("the primary became a replica (a Sentinel switch-over)"))
            raise replies.lost  # type: ignore[misc]
        return raw

    @property
    def managed(self) -> bool:
        """Whether the connection goes to a primary Redis Sentinel manages."""
        return isinstance(self._like, SentinelManagedConnection)

    @property
    def connected_to(self) -> tuple[str, int] | None:
        """The host and port the open connection goes to (TCP); None while none is open."""
        replies = self._replies
        return self._address if replies is not None and replies.lost is None else None

    def drop(self, why: str) -> None:
        """Give up the open connection (what waits on it fails): the next command opens
        another, to the primary the sentinels name then."""
        if self._replies is not None:
            _drop(self._replies, ConnectionError(why))

    async def _connected(self) -> _Replies:
        """The open connection, opened by the first caller to need it; the others wait for it."""
        if self._connecting is None:
            self._replies = None
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            self._replies = await asyncio.shield(connecting)
            return self._replies
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Replies:
        loop, like = asyncio.get_running_loop(), self._like
        replies = _Replies(self._reader_options)
        if isinstance(like, UnixDomainSocketConnection):
            transport, _ = await loop.create_unix_connection(lambda: replies, like.path)
        else:  # TCP_NODELAY, as asyncio sets it
            tls = like.ssl_context.get() if isinstance(like, SSLConnection) else None
            self._address = await self._where()
            transport, _ = await loop.create_connection(lambda: replies, *self._address, ssl=tls)
        replies.transport = transport  # uvloop may tell the protocol only a loop turn later
        handshake = _handshake(like)
        answers = await replies.send(b"".join(pack(c) for c in handshake), len(handshake)) if handshake else []
        refused = next((a for a in answers if isinstance(a, Exception)), None)
        if refused is not None:  # a wrong password, a database that does not exist
            assert replies.transport is not None
            replies.transport.close()
            raise refused
        return replies

    async def _where(self) -> tuple[str, int]:
        """The server's host and port: the primary the sentinels name now, for a managed one."""
        if self.managed:
            host, port = await self._like.connection_pool.get_master_address()
            return host, int(port)
        return self._like.host, self._like.port

    def _parsed(self, reply: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        """What redis-py's ``parse_response`` makes of a raw reply."""
        if isinstance(reply, Exception):
            return reply
        callback = self._callbacks.get(args[0])
        if callback is None:
            return reply
        return callback(reply, **{k: v for k, v in options.items() if k != "keys"})


def _drop(replies: _Replies, why: ConnectionError) -> None:
    """Give up a connection: what waits on it fails with ``why``, and it is closed."""
    replies.connection_lost(why)
    if replies.transport is not None:
        replies.transport.abort()


def _handshake(like: aioredis.Connection) -> list[tuple[Any, ...]]:
    """What redis-py sends on a new connection before its first command: the protocol
    (RESP3 unless the URL asks for 2) with the credentials, the client's name, the database."""
    commands: list[tuple[Any, ...]] = []
    if like.protocol == 3:
        credentials = ("AUTH", like.username or "default", like.password) if like.password is not None else ()
        commands.append(("HELLO", 3, *credentials))
    elif like.password is not None:  # a password alone for a Redis older than 6, as redis-py sends it
        commands.append(("AUTH", like.username, like.password) if like.username else ("AUTH", like.password))
    if like.client_name:
        commands.append(("CLIENT", "SETNAME", like.client_name))
    if like.db:
        commands.append(("SELECT", like.db))
    return commands
