"""The gateway's HTTP surface: OpenAI's chat completions, sessions, health and metrics.

A thin FastAPI shell over the coordinator (gateway.coordinator): it reads and checks
the request, maps every failure to an OpenAI-shaped error with its status code, and
relays the exchange's events as they come.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.api import APIError, ChatRequest
from gateway.config import GatewayConfig
from gateway.coordinator import Gateway
from gateway.outage import REDIS_DOWN
from gateway.upstream import Reply, UpstreamError


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="ampd gateway", lifespan=lifespan)
    app.state.gateway = gateway
    app.openapi = lambda: _document(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        gateway.metrics.requests.labels(str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(aioredis.RedisError)
    async def redis_error(request: Request, exc: aioredis.RedisError) -> JSONResponse:
        """What cannot go on without Redis (a session's records, say) says so (gateway.outage)."""
        gateway.health.failed("request", exc)
        return await api_error(request, APIError(503, f"shared state unavailable: {exc}", code="redis_unavailable"))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Ready while a decode worker is known. Without Redis the replica still serves
        (gateway.outage), so it stays in rotation and says it is degraded."""
        problems = []
        try:
            await gateway.redis.ping()
        except REDIS_DOWN as exc:
            problems.append(f"redis: {exc}")
        serving = any(w.info.decodes for w in gateway.pool.workers.values())
        if not serving:
            problems.append("no decode worker")
        status = "not ready" if not serving else "degraded" if problems else "ready"
        body = {"status": status, "problems": problems, "workers": sorted(gateway.pool.workers)}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(aioredis.RedisError, OSError):  # a Redis outage must not hide the rest
            gateway.metrics.sessions_active.set(await gateway.sessions.active())
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        scope = gateway.authenticate(request.headers.get("authorization"))
        raw = await _read_json(request, config.max_body_bytes)
        try:
            ex, first_round = await gateway.open(raw, dict(request.headers), scope)
        except UpstreamError as exc:  # counting the prompt failed: no worker to blame the client for
            raise _upstream_api_error(exc) from exc
        client = Reply(started=ex.arrival)
        events = gateway.converse(ex, first_round, client)
        try:
            first = await anext(events)  # errors up to the first token still get a status code
        except UpstreamError as exc:
            raise _upstream_api_error(exc) from exc
        route = first_round.plan.route  # as decided; the decode worker as it is now (a lost one is replaced)
        headers = {"X-Session-Id": ex.session.session_id, "X-AMPD-Route": f"{route.kind}:{route.worker_id}",
                   "X-AMPD-Decode-Worker": first_round.decode.info.worker_id}  # fmt: skip
        if raw.get("stream"):
            gateway.metrics.requests.labels("200").inc()
            return StreamingResponse(_relay(first, events), media_type="text/event-stream", headers=headers)
        async for _ in _safe(events):
            pass
        gateway.metrics.requests.labels("200").inc()
        body = client.completion()
        if ex.rounds:
            body["ampd_tool_rounds"] = ex.rounds
        return JSONResponse(body, headers=headers)

    return app


def _document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI document plus the chat request's body, which FastAPI cannot see:
    the route reads its body itself, for the size limit and OpenAI-shaped errors."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        body = ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(body.pop("$defs", {}), ChatRequest=body)
        content = {"application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}
        document["paths"]["/v1/chat/completions"]["post"]["requestBody"] = {"required": True, "content": content}
        app.openapi_schema = document
    return app.openapi_schema


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


async def _relay(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    try:
        async for event in rest:
            yield event
    except (UpstreamError, APIError) as exc:  # the status line is gone: report in-band, as vLLM does
        error = _upstream_api_error(exc) if isinstance(exc, UpstreamError) else exc
        yield f"data: {json.dumps(error.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"


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
