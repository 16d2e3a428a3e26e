"""An API request relayed: the caller's scope and body read, its exchange opened, its answer
sent whole or streamed, every failure mapped to an error in the API's own shape.

Each API's routes (gateway.apis.chat, gateway.apis.responses, gateway.apis.messages) go
through one :class:`Relay`: ``begin`` reads the request, ``start`` opens the exchange on the
coordinator and waits for its first event, so that errors up to the first token still get
a status code; after it, failures go in-band, in the stream's API (:class:`EventStream`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson
import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.apis.schema import APIError, Origins
from gateway.coordinator import Gateway
from gateway.engines.upstream import Reply, UpstreamError
from gateway.exchange import Exchange
from gateway.rounds import Round

ErrorShape = Callable[[APIError], dict[str, Any]]


@dataclass
class Started:
    """An exchange whose first event is in: its status is 200, and later errors go in-band."""

    ex: Exchange
    first_round: Round
    client: Reply  # the reply as the client gets it, filled as the events pass
    first: bytes
    events: AsyncIterator[bytes]
    headers: dict[str, str]  # X-Session-Id, X-AMPD-Route, X-AMPD-Decode-Worker
    round: int  # the first round's number in its session (the session's rounds so far, plus one)

    @property
    def model(self) -> str:
        return self.ex.body["model"]


class Relay:
    """What every API route does with the gateway (the coordinator). ``error_shapes``: the
    error body of each API whose errors are not OpenAI's, by the path its routes start with."""

    def __init__(self, gateway: Gateway, error_shapes: Mapping[str, ErrorShape]) -> None:
        self.gateway, self.error_shapes = gateway, dict(error_shapes)

    async def begin(self, request: Request, api_key_header: bool = False) -> tuple[str, dict[str, Any]]:
        """The caller's scope and the request's JSON body, as every API route starts."""
        api_key = request.headers.get("x-api-key") if api_key_header else None
        scope = self.gateway.authenticate(request.headers.get("authorization"), api_key)
        return scope, await read_json(request, self.gateway.config.max_body_bytes)

    async def start(
        self,
        chat: dict[str, Any],
        request: Request,
        scope: str,
        session_id: str | None = None,
        origins: Origins | None = None,
    ) -> Started:
        """Open the exchange for a chat body and wait for its first event: errors up to
        the first token still get a status code, naming the fields of the API asked
        (``origins``: where a translated body's parts came from)."""
        try:
            return await self._start(chat, request, scope, session_id)
        except APIError as exc:
            if origins is None:
                raise
            raise origins.error(exc) from exc

    async def _start(self, chat: dict[str, Any], request: Request, scope: str, session_id: str | None) -> Started:
        try:
            ex, first_round = await self.gateway.open(chat, dict(request.headers), scope, session_id)
        except UpstreamError as exc:  # counting the prompt failed: no worker to blame the client for
            raise upstream_api_error(exc) from exc
        client = Reply(started=ex.arrival)
        events = self.gateway.converse(ex, first_round, client)
        try:
            first = await anext(events)
        except UpstreamError as exc:
            raise upstream_api_error(exc) from exc
        route = first_round.plan.route  # as decided; the decode worker as it is now (a lost one is replaced)
        headers = {"X-Session-Id": _header_value(ex.session.session_id),
                   "X-AMPD-Route": f"{route.kind}:{route.worker_id}",
                   "X-AMPD-Decode-Worker": first_round.decode.info.worker_id}  # fmt: skip
        started = Started(ex, first_round, client, first, events, headers, ex.session.state.rounds + 1)
        request.state.exchange = started  # for the access line (gateway.access_log)
        return started

    async def finish(self, started: Started) -> None:
        """Run a non-streaming exchange to its end (``started.client`` holds the reply)."""
        async for _ in _safe(started.events):
            pass

    def ok(self, body: dict[str, Any], started: Started) -> JSONResponse:
        self.gateway.metrics.requests.labels("200").inc()
        return JSONResponse(body, headers=started.headers)

    def streaming(
        self, first: bytes, rest: AsyncIterator[bytes], fail: Callable[[APIError], bytes], started: Started
    ) -> EventStream:
        self.gateway.metrics.requests.labels("200").inc()
        return EventStream(first, rest, fail, started.headers)

    async def error(self, request: Request, exc: Exception) -> JSONResponse:
        """The answer to a failure before the first event, in the shape of the API asked
        (OpenAI's unless ``error_shapes`` says otherwise). What cannot go on without Redis
        (a session's records, say) says so (gateway.state.outage)."""
        if isinstance(exc, aioredis.RedisError):
            self.gateway.health.failed("request", exc)
            exc = APIError(503, f"shared state unavailable: {exc}", code="redis_unavailable")
        if not isinstance(exc, APIError):
            raise exc
        self.gateway.metrics.requests.labels(str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        path = request.url.path
        shape = next((s for prefix, s in self.error_shapes.items() if path.startswith(prefix)), APIError.body)
        return JSONResponse(shape(exc), status_code=exc.status, headers=headers)


def relay(request: Request) -> Relay:
    """The app's relay (a FastAPI dependency)."""
    return request.app.state.relay


class EventStream(StreamingResponse):
    """Starlette's streaming response, but listening for the client's hang-up with one
    plain task instead of an anyio task group per response. As there, a hang-up
    cancels the stream - the exchange's generators unwind, the engine request is closed
    (and so aborted), the round's holds let go - and the response ends quietly.

    The stream is ``first``, then ``rest``. A failure in ``rest`` comes after the status
    line: the client gets it in-band, as ``fail`` writes it in the stream's API (as vLLM
    does for chat), and the stream ends there. The chat stream goes to the client
    straight from the exchange, without a generator of the response's own in between."""

    def __init__(
        self, first: bytes, rest: AsyncIterator[bytes], fail: Callable[[APIError], bytes], headers: Mapping[str, str]
    ) -> None:
        super().__init__(rest, media_type="text/event-stream", headers=headers)
        self.first, self.fail = first, fail

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        try:
            async for events in self.body_iterator:
                await send({"type": "http.response.body", "body": events, "more_body": True})
        except (UpstreamError, APIError) as exc:
            error = upstream_api_error(exc) if isinstance(exc, UpstreamError) else exc
            await send({"type": "http.response.body", "body": self.fail(error), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        hung_up = finished = False

        def cancel(_: asyncio.Future) -> None:
            nonlocal hung_up
            if not finished:  # else the receive returned because the response is complete
                hung_up = True
                task.cancel()

        listener = asyncio.ensure_future(_disconnect(receive))
        listener.add_done_callback(cancel)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not hung_up:  # the server's own cancellation (a shutdown) goes on
                raise
            task.uncancel()
        finally:
            finished = True
            listener.cancel()


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    try:  # orjson: strict JSON (no NaN or Infinity, engines refuse them too), UTF-8 only
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def joined(events: Callable[[APIError], list[bytes]]) -> Callable[[APIError], bytes]:
    return lambda error: b"".join(events(error))


async def translated(
    started: Started,
    feed: Callable[[dict[str, Any]], list[bytes]],
    remember: Callable[[], Any] | None,
    closing: Callable[[], list[bytes]],
) -> AsyncIterator[bytes]:
    """A chat stream re-spoken in another API's events, after its opening ones: ``feed``
    turns each chat chunk into that API's events, ``closing`` ends them once the exchange
    is over; ``remember`` runs after ``closing`` (and may store what it made) but before
    the client gets its events, so what it stores is there when the client sees the end."""
    async for chunk in _chat_chunks(started.first, started.events):
        out = feed(chunk)
        if out:
            yield b"".join(out)
    last = b"".join(closing())
    if remember is not None:
        await remember()
    yield last


def upstream_api_error(exc: UpstreamError) -> APIError:
    error = (exc.body or {}).get("error") if isinstance(exc.body, dict) else None
    if error and 400 <= exc.status < 500:  # the engine refused the request itself: pass it on
        return APIError(exc.status, error.get("message", str(exc)), error.get("param"))
    return APIError(502, f"upstream failure: {exc}", code="upstream_error")


def _header_value(value: str) -> str:
    """``value`` as a header may carry it: a session id from a body field may hold any
    character, and one a header cannot carry is percent-encoded (as a URL path takes it)."""
    return value if value.isascii() and value.isprintable() else quote(value, safe="")  # " " to "~"


async def _disconnect(receive: Receive) -> None:
    """Returns once the client is gone (the request's body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _chat_chunks(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The chat chunks (JSON) of the exchange's SSE events, ``[DONE]`` left out."""
    pending, data = b"", first
    while True:
        *events, pending = (pending + data).split(b"\n\n")
        for event in events:
            if event.startswith(b"data: ") and event[6:] != b"[DONE]":
                yield json.loads(event[6:])
        try:
            data = await anext(rest)
        except StopAsyncIteration:
            return


async def _safe(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    except UpstreamError as exc:
        raise upstream_api_error(exc) from exc
