"""Kept-alive HTTP/1.1 connections from the gateway to its engines.

A round's decode stream is the gateway's busiest HTTP exchange: a POST, then one body
chunk per step of the engine. Through aiohttp's client a stream cost the gateway several
times the CPU of the same bytes written on a plain asyncio connection, and reached the
engine's response headers later (bench/studies/overhead_hot_path/engine_client.py,
docs/studies/overhead.md). Here a request is written in one
call and its response parsed by httptools (llhttp, the parser uvicorn serves with) as it
arrives; the body's chunks reach the reader together, as they came in since it last
looked, and a reader that falls behind stops the socket being read.

What the gateway relies on, as with aiohttp: a refused connection, and one that fails or
closes before the response is complete, raise :class:`Lost`; a request past its
deadline raises :class:`TimedOut` (a kind of Lost); a response is complete only once its
last chunk arrived; a reader that stops early (the client hung up) closes the
connection, and so aborts the engine's request. Connections idle longer than
``keepalive_s`` are dropped rather than reused, before the server's own keep-alive
timeout could close one under a new request; where one closes anyway (a gateway starved of
CPU reads the server's close late), the request goes once more on a new connection.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

PAUSE_CHUNKS = 64  # unread body chunks before the engine's socket stops being read (back-pressure)


class Lost(Exception):
    """The connection failed, closed or timed out before the response was complete."""


class TimedOut(Lost):
    """The response was not complete by the request's deadline."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; its current response's body waits in ``chunks``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.chunks: list[bytes] = []
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None  # why the connection ended
        self.waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.reused = False  # taken from the idle ones: it has served a request before
        self.answered = False  # some of the current response arrived

    # -- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = Lost(f"malformed response: {exc}")
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = Lost(f"connection closed: {exc!r}" if exc else "connection closed")
        self.transport = None
        self._wake()

    # -- httptools callbacks ---------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        if len(self.chunks) >= PAUSE_CHUNKS and self.transport is not None:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete, self.keep_alive = True, self.parser.should_keep_alive()

    # -- the reader's side -------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.error is None

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.chunks, self.complete, self.keep_alive, self.answered = 0, [], False, False, False
        self.transport.write(request)

    async def wait(self) -> None:
        """Until something arrived, the response completed or the connection ended."""
        if self.chunks or self.complete or self.error is not None:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        """The body that arrived since the last take."""
        chunks, self.chunks = self.chunks, []
        if self.transport is not None and len(chunks) >= PAUSE_CHUNKS:
            self.transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    @property
    def closed_under_request(self) -> bool:
        """A kept-alive connection that ended before any of the response came. Almost
        always the server closed it idle (its keep-alive ran out) as the request went out,
        and no application saw the request, so it is sent once more on a new connection. A
        server that took it and then died refuses the new one; one that took it and closed
        the connection on purpose runs the request twice, the first copy aborted with its
        connection - for an engine, a generation's cost and nothing else."""
        return self.reused and not self.answered and self.error is not None and not isinstance(self.error, TimedOut)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


@dataclass
class Response:
    """A response whose body is still arriving: ``status``, then :meth:`body`."""

    status: int
    _connection: _Connection

    async def body(self) -> AsyncIterator[bytes]:
        """The body as it arrives: everything that came in since the last step, joined."""
        connection = self._connection
        while True:
            await connection.wait()
            if connection.chunks:
                yield connection.take()
            elif connection.complete:
                return
            elif connection.error is not None:
                raise connection.error

    async def read(self) -> bytes:
        return b"".join([part async for part in self.body()])


@dataclass
class EngineConnections:
    """Idle connections per engine (``host:port``), the most recently used taken first."""

    keepalive_s: float
    connect_timeout_s: float
    timeout_s: float  # a request's deadline, from its start to its last byte
    _idle: dict[tuple[str, int], list[_Connection]] = field(default_factory=dict)

    @asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Response]:
        """``method`` on ``url``; the response once its headers are in, to be read within
        ``timeout_s`` (else the pool's). The connection goes back for reuse only if the
        response was read to its end."""
        host, port, target = _endpoint(url)
        request = _request(method, target, f"{host}:{port}", body, headers or {})
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + timeout_s
        connection = await self._connection(host, port)
        deadline = loop.call_at(deadline_at, _expire, connection, timeout_s)
        try:
            connection.send(request)
            while not connection.status:
                if connection.closed_under_request:  # once: the new connection is not reused
                    deadline.cancel()
                    connection = await self._connect(host, port)
                    deadline = loop.call_at(deadline_at, _expire, connection, timeout_s)
                    connection.send(request)
                elif connection.error is not None:
                    raise connection.error
                await connection.wait()
            yield Response(connection.status, connection)
        finally:
            deadline.cancel()
            if connection.complete and connection.keep_alive and connection.usable:
                self._keep((host, port), connection)
            else:
                connection.close()

    async def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    def _keep(self, engine: tuple[str, int], connection: _Connection) -> None:
        """Back to the idle ones, most recent last; those gone stale below it go (the most
        recent is taken first, so the oldest would otherwise wait there for ever)."""
        idle = self._idle.setdefault(engine, [])
        while idle and not self._reusable(idle[0]):
            idle.pop(0).close()
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def _reusable(self, connection: _Connection) -> bool:
        """Open, and idle for less than ``keepalive_s``."""
        return connection.usable and connection.idle_since > time.monotonic() - self.keepalive_s

    async def _connection(self, host: str, port: int) -> _Connection:
        """The most recently used idle connection to the engine, else a new one."""
        idle = self._idle.get((host, port), [])
        while idle:
            connection = idle.pop()
            if self._reusable(connection):
                connection.reused = True
                return connection
            connection.close()
        return await self._connect(host, port)

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(_Connection, host, port)
        except (OSError, TimeoutError) as exc:
            raise Lost(f"cannot connect: {exc!r}") from exc
        return connection


@functools.lru_cache(maxsize=1024)  # the engines' few URLs, parsed once rather than on every request
def _endpoint(url: str) -> tuple[str, int, str]:
    """The host, port and request target of an engine's ``url``."""
    parts = urlsplit(url)
    if parts.scheme != "http":  # no TLS here: plain bytes to a TLS port would read as a lost engine
        raise ValueError(f"{url}: engines are reached over http:// only")
    target = f"{parts.path or '/'}?{parts.query}" if parts.query else parts.path or "/"
    return parts.hostname or "", parts.port or 80, target


def _request(method: str, target: str, host: str, body: bytes | None, headers: dict[str, str]) -> bytes:
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    if body is None:
        return f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode()
    return f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def _expire(connection: _Connection, timeout_s: float) -> None:
    connection.error = TimedOut(f"no complete response within {timeout_s:g} s")
    connection.close()
