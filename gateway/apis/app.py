"""The gateway's HTTP surface: the APIs agents speak, sessions, health and metrics.

A thin FastAPI shell over the coordinator (gateway.coordinator): it reads and checks
the request, maps every failure to an error with its status code, and relays the
exchange's events as they come. Three APIs share one path (``begin`` reads the request,
``start`` opens the exchange and waits for its first event, both in :func:`create_app`): OpenAI's
chat completions as they are, OpenAI's Responses API (gateway.apis.responses) and
Anthropic's Messages API (gateway.apis.messages) translated at the edge into a chat
body and back. Errors take the shape of the API that was asked: OpenAI's for the
first two, Anthropic's for ``/v1/messages``. Chat completions, the hot path, skip
FastAPI's routing and middleware (:class:`GatewayApp`); every other route goes through them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from gateway.apis import messages as messages_api
from gateway.apis import responses as responses_api
from gateway.apis.schema import APIError, ChatRequest
from gateway.config import GatewayConfig
from gateway.coordinator import Gateway
from gateway.engines.upstream import Reply, UpstreamError
from gateway.exchange import Exchange
from gateway.metrics import MULTIPROCESS_DIR, GatewayMetrics
from gateway.rounds import Round
from gateway.state.outage import REDIS_DOWN
from gateway.tracing import configure_otlp
from surface.parent_death import end_with_parent

CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"  # Anthropic's API (and its count_tokens): its errors have Anthropic's shape
CONFIG_ENV = "AMPD_GATEWAY_CONFIG"  # a gateway of several processes: each one's configuration (JSON)
OTLP_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"  # OpenTelemetry's own variable


@dataclass
class Started:
    """An exchange whose first event is in: its status is 200, and later errors go in-band."""

    ex: Exchange
    first_round: Round
    client: Reply  # the reply as the client gets it, filled as the events pass
    first: bytes
    events: AsyncIterator[bytes]
    headers: dict[str, str]  # X-Session-Id, X-AMPD-Route, X-AMPD-Decode-Worker

    @property
    def model(self) -> str:
        return self.ex.body["model"]


Endpoint = Callable[[Request], Awaitable[Response]]


class GatewayApp(FastAPI):
    """FastAPI with a short way in for the hot route. A POST to a path registered with
    :meth:`post_direct` is answered by its endpoint straight from the ASGI call, with
    the app's own exception handlers: no routing, no middleware, no exception layers
    wrapping each streamed chunk's ``send`` (README, the hot path). The route is
    registered with FastAPI as well, so the OpenAPI document describes it as before."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.direct: dict[str, Endpoint] = {}

    def post_direct(self, path: str) -> Callable[[Endpoint], Endpoint]:
        def register(endpoint: Endpoint) -> Endpoint:
            self.direct[path] = endpoint
            return self.post(path)(endpoint)

        return register

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.direct.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            await super().__call__(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:  # uvicorn answers 500, as Starlette's outermost layer would
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[[Request, Exception], Awaitable[Response]] | None:
        """The handler Starlette would pick: the nearest registered class in the exception's MRO."""
        for cls in type(exc).__mro__:
            if cls in self.exception_handlers:
                return self.exception_handlers[cls]
        return None


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
            error = _upstream_api_error(exc) if isinstance(exc, UpstreamError) else exc
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


def create_app(config: GatewayConfig) -> GatewayApp:
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        # What exists now (modules, the app, its routes, the pools) lives as long as the
        # process: frozen out of the collector's sight, a full collection walks only what
        # requests made since. Unfrozen, each one stalled a loaded replica's event loop for
        # about 100 ms every few seconds, which is where its TTFT p99 came from (README, Load).
        gc.collect()
        gc.freeze()
        yield
        await gateway.stop()
        GatewayMetrics.process_exits()

    app = GatewayApp(title="ampd gateway", lifespan=lifespan)
    app.state.gateway = gateway
    app.openapi = lambda: _document(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        gateway.metrics.requests.labels(str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        body = messages_api.error_body(exc) if request.url.path.startswith(MESSAGES_PATH) else exc.body()
        return JSONResponse(body, status_code=exc.status, headers=headers)

    @app.exception_handler(aioredis.RedisError)
    async def redis_error(request: Request, exc: aioredis.RedisError) -> JSONResponse:
        """What cannot go on without Redis (a session's records, say) says so (gateway.state.outage)."""
        gateway.health.failed("request", exc)
        return await api_error(request, APIError(503, f"shared state unavailable: {exc}", code="redis_unavailable"))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Ready while a decode worker is known. Without Redis the replica still serves
        (gateway.state.outage), so it stays in rotation and says it is degraded. It names the
        replica (the process, where several share the port) that answered."""
        problems = []
        try:
            await gateway.redis.ping()
        except REDIS_DOWN as exc:
            problems.append(f"redis: {exc}")
        serving = any(w.info.decodes for w in gateway.pool.workers.values())
        if not serving:
            problems.append("no decode worker")
        status = "not ready" if not serving else "degraded" if problems else "ready"
        body = {"status": status, "problems": problems, "workers": sorted(gateway.pool.workers),
                "replica": config.replica_id}  # fmt: skip
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(aioredis.RedisError, OSError):  # a Redis outage must not hide the rest
            gateway.metrics.sessions_active.set(await gateway.sessions.active())
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.authenticate(request.headers.get("authorization"))
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "ampd"} for m in gateway.pool.models()]
        return {"object": "list", "data": data}

    @app.get("/v1/sessions/{session_id}")
    async def session_rounds(session_id: str, request: Request) -> dict[str, Any]:
        """Every round of a session: route, queue wait, TTFT, ITL. Scoped to the caller's key,
        so another tenant's session id is simply not found."""
        scope = gateway.authenticate(request.headers.get("authorization"))
        session = await gateway.sessions.load(scope, session_id)
        if session is None:
            raise APIError(404, f"No session found with id '{session_id}'.", code="session_not_found")
        return {
            "id": session_id, "object": "session", "created": int(session.created),
            "decode_worker": session.state.decode_worker, "rounds": await gateway.sessions.rounds(scope, session_id),
        }  # fmt: skip

    responses_store = responses_api.ResponseStore(gateway.redis, config.key_prefix, config.session_ttl_s)

    async def begin(request: Request, api_key_header: bool = False) -> tuple[str, dict[str, Any]]:
        """The caller's scope and the request's JSON body, as every API route starts."""
        api_key = request.headers.get("x-api-key") if api_key_header else None
        scope = gateway.authenticate(request.headers.get("authorization"), api_key)
        return scope, await _read_json(request, config.max_body_bytes)

    async def start(chat: dict[str, Any], request: Request, scope: str, session_id: str | None = None) -> Started:
        """Open the exchange for a chat body and wait for its first event: errors up to
        the first token still get a status code."""
        try:
            ex, first_round = await gateway.open(chat, dict(request.headers), scope, session_id)
        except UpstreamError as exc:  # counting the prompt failed: no worker to blame the client for
            raise _upstream_api_error(exc) from exc
        client = Reply(started=ex.arrival)
        events = gateway.converse(ex, first_round, client)
        try:
            first = await anext(events)
        except UpstreamError as exc:
            raise _upstream_api_error(exc) from exc
        route = first_round.plan.route  # as decided; the decode worker as it is now (a lost one is replaced)
        headers = {"X-Session-Id": _header_value(ex.session.session_id),
                   "X-AMPD-Route": f"{route.kind}:{route.worker_id}",
                   "X-AMPD-Decode-Worker": first_round.decode.info.worker_id}  # fmt: skip
        return Started(ex, first_round, client, first, events, headers)

    async def finish(started: Started) -> None:
        """Run a non-streaming exchange to its end (``started.client`` holds the reply)."""
        async for _ in _safe(started.events):
            pass

    def ok(body: dict[str, Any], started: Started) -> JSONResponse:
        gateway.metrics.requests.labels("200").inc()
        if started.ex.rounds:
            body["ampd_tool_rounds"] = started.ex.rounds
        return JSONResponse(body, headers=started.headers)

    def streaming(
        first: bytes, rest: AsyncIterator[bytes], fail: Callable[[APIError], bytes], started: Started
    ) -> EventStream:
        gateway.metrics.requests.labels("200").inc()
        return EventStream(first, rest, fail, started.headers)

    @app.post_direct(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions, relayed as the engines speak it."""
        scope, raw = await begin(request)
        started = await start(raw, request, scope)
        if raw.get("stream"):
            return streaming(started.first, started.events, _chat_failure, started)
        await finish(started)
        return ok(started.client.completion(), started)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API (gateway.apis.responses), ``previous_response_id`` included."""
        scope, raw = await begin(request)
        asked = responses_api.parse_request(raw)
        history, session_id = [], None
        if asked.previous_response_id:
            stored = await responses_store.load(scope, asked.previous_response_id)
            history, session_id = stored["messages"], stored["session_id"]
        started = await start(responses_api.to_chat(raw, asked, history), request, scope, session_id)
        response_id, created = responses_api.new_response_id(), int(time.time())
        client = started.client

        async def remember() -> None:
            """Store the conversation after the instructions, the reply included. Without Redis
            the answer still stands; only its continuation by ``previous_response_id`` is lost."""
            if not asked.store:
                return
            messages = started.ex.client_messages[1 if asked.instructions else 0 :] + [client.message()]
            try:
                await responses_store.save(scope, response_id, started.ex.session.session_id, messages)
            except REDIS_DOWN as exc:
                gateway.health.failed("response", exc)

        if asked.stream:
            events = responses_api.ResponseEvents(response_id, asked, started.model, created)

            def completed() -> list[bytes]:
                return events.finish(client.usage, client.finish_reason)

            relayed = _translated(started, events.feed, remember, completed)
            return streaming(b"".join(events.start()), relayed, _joined(events.fail), started)
        await finish(started)
        await remember()
        output = responses_api.output_items(client.message())
        body = responses_api.response_object(response_id, asked, started.model, created, output, "completed",
                                             client.usage, client.finish_reason)  # fmt: skip
        return ok(body, started)

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (gateway.apis.messages); the key in ``x-api-key`` or as a Bearer token."""
        scope, raw = await begin(request, api_key_header=True)
        asked = messages_api.parse_request(raw)
        started = await start(messages_api.to_chat(raw, asked), request, scope)
        message_id, client = messages_api.new_message_id(), started.client
        if asked.stream:
            prompt = started.first_round.plan.task.l_total
            stream = messages_api.MessageEvents(message_id, started.model, prompt, asked.stop_sequences)

            def stopped() -> list[bytes]:
                return stream.finish(client.finish_reason, client.stop_reason, client.usage)

            relayed = _translated(started, stream.feed, None, stopped)
            return streaming(b"".join(stream.start()), relayed, _joined(stream.fail), started)
        await finish(started)
        body = messages_api.message_object(message_id, started.model, client.message(), client.finish_reason,
                                           client.stop_reason, asked.stop_sequences, client.usage)  # fmt: skip
        return ok(body, started)

    @app.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(request: Request) -> dict[str, int]:
        """Anthropic's token counting: the prompt a Messages request would have, counted by an engine."""
        _, raw = await begin(request, api_key_header=True)  # counted, not run: no session
        asked = messages_api.parse_request(raw, messages_api.CountTokensRequest)
        try:
            return {"input_tokens": await gateway.count(messages_api.to_chat(raw, asked))}
        except UpstreamError as exc:
            raise _upstream_api_error(exc) from exc

    return app


def prepare_process(config: GatewayConfig, otlp_endpoint: str | None) -> None:
    """What a gateway process sets up before its app: span export, the content log."""
    if otlp_endpoint:
        configure_otlp(otlp_endpoint)
    if config.log_content:
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("ampd.content").setLevel(logging.INFO)


def serve(
    config: GatewayConfig, host: str, port: int, processes: int, otlp_endpoint: str | None, log_level: str
) -> None:
    """Serve the gateway on ``host:port``: one process, or ``processes`` of them sharing the
    port (uvicorn's workers: the parent holds the socket and keeps them running). A single
    event loop is what saturates first (README, the hot path): a host's cores go further
    as several replicas behind one port than as one."""
    if processes == 1:
        prepare_process(config, otlp_endpoint)
        uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, access_log=False)
        return
    with tempfile.TemporaryDirectory(prefix="ampd-metrics-") as metrics_dir:
        os.environ[CONFIG_ENV] = config.model_dump_json(exclude={"replica_id"})
        os.environ[MULTIPROCESS_DIR] = metrics_dir
        if otlp_endpoint:
            os.environ[OTLP_ENV] = otlp_endpoint
        uvicorn.run("gateway.apis.app:app_from_environment", factory=True, workers=processes, host=host, port=port,
                    log_level=log_level, access_log=False)  # fmt: skip


def app_from_environment() -> FastAPI:
    """The app of one of several gateway processes sharing a port (``ampd gateway
    --processes``, uvicorn's workers): its configuration comes from the parent in
    ``AMPD_GATEWAY_CONFIG``, without a replica id - each process is a replica of its own,
    as replicas on different hosts are (they share their state in Redis)."""
    config = GatewayConfig.model_validate_json(os.environ[CONFIG_ENV])
    # A process of several ends with its parent, so a gateway stopped hard leaves no replica
    # serving that nobody can stop: uvicorn's parent waits for its workers, and a worker slow
    # to shut down once got its parent killed by the caller's deadline and stayed behind.
    end_with_parent(signal.SIGKILL)
    prepare_process(config, os.environ.get(OTLP_ENV))
    return create_app(config)


DOCUMENTED_BODIES = {  # the request bodies FastAPI cannot see: the routes read them themselves
    CHAT_PATH: ChatRequest,
    "/v1/responses": responses_api.ResponsesRequest,
    MESSAGES_PATH: messages_api.MessagesRequest,
    f"{MESSAGES_PATH}/count_tokens": messages_api.CountTokensRequest,
}


def _document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI document plus the request bodies of the three APIs, which FastAPI
    cannot see: the routes read their bodies themselves, for the size limit and their errors."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for path, model in DOCUMENTED_BODIES.items():
            name = model.__name__
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}), **{name: body})
            content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
            document["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
        app.openapi_schema = document
    return app.openapi_schema


def _header_value(value: str) -> str:
    """``value`` as a header may carry it: a session id from a body field may hold any
    character, and one a header cannot carry is percent-encoded (as a URL path takes it)."""
    return value if value.isascii() and value.isprintable() else quote(value, safe="")  # " " to "~"


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    try:  # orjson: strict JSON (no NaN or Infinity, engines refuse them too), UTF-8 only; 2-8x the stdlib's speed
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


async def _disconnect(receive: Receive) -> None:
    """Returns once the client is gone (the request's body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _chat_failure(error: APIError) -> bytes:
    return f"data: {json.dumps(error.body())}\n\n".encode() + b"data: [DONE]\n\n"


def _joined(events: Callable[[APIError], list[bytes]]) -> Callable[[APIError], bytes]:
    return lambda error: b"".join(events(error))


async def _translated(
    started: Started,
    feed: Callable[[dict[str, Any]], list[bytes]],
    remember: Callable[[], Any] | None,
    closing: Callable[[], list[bytes]],
) -> AsyncIterator[bytes]:
    """A chat stream re-spoken in another API's events, after its opening ones: ``feed``
    turns each chat chunk into that API's events, ``closing`` ends them once the exchange
    is over (after ``remember``, so what it stores is there when the client sees the end)."""
    async for chunk in _chat_chunks(started.first, started.events):
        out = feed(chunk)
        if out:
            yield b"".join(out)
    if remember is not None:
        await remember()
    yield b"".join(closing())


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
        raise _upstream_api_error(exc) from exc


def _upstream_api_error(exc: UpstreamError) -> APIError:
    error = (exc.body or {}).get("error") if isinstance(exc.body, dict) else None
    if error and 400 <= exc.status < 500:  # the engine refused the request itself: pass it on
        return APIError(exc.status, error.get("message", str(exc)), error.get("param"))
    return APIError(502, f"upstream failure: {exc}", code="upstream_error")
