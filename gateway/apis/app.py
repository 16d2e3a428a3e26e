"""The gateway's HTTP surface: the APIs agents speak, sessions, health and metrics.

A thin FastAPI shell over the coordinator (gateway.coordinator): each API's routes in a
router of its own (gateway.apis.chat, gateway.apis.responses, gateway.apis.messages, and
the gateway's own in gateway.apis.service), all relayed the same way (gateway.apis.relay).
OpenAI's chat completions go as they are; the Responses API and Anthropic's Messages API
are translated at the edge into a chat body and back, and their errors take the shape of
the API that was asked. Chat completions, the hot path, skip FastAPI's routing and
middleware (:class:`HotPath`); every other request goes through them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.access_log import AccessLog, open_access_log, per_process
from gateway.apis import chat, messages, responses, service
from gateway.apis.chat import CHAT_PATH
from gateway.apis.messages import MESSAGES_PATH
from gateway.apis.relay import Relay
from gateway.apis.schema import APIError, ChatRequest, validation_error
from gateway.assemble import assemble
from gateway.config import GatewayConfig
from gateway.metrics import MULTIPROCESS_DIR, GatewayMetrics
from gateway.tracing import configure_otlp
from surface.parent_death import end_with_parent

CONFIG_ENV = "AMPD_GATEWAY_CONFIG"  # a gateway of several processes: each one's configuration (JSON)
OTLP_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"  # OpenTelemetry's own variable
HANDLED = (APIError, aioredis.RedisError)  # the failures answered in the API's shape; others are a 500

OPEN_WARNING = (
    "open mode: no API key is configured (--api-key, --api-keys-file), so any caller may use "
    "the gateway and every caller sees every session; sessions are not tenant-scoped"
)
log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


class HotPath:
    """The ASGI app a gateway process serves: a POST to the hot path is answered by its
    endpoint straight from the ASGI call - no routing, no middleware, no exception layers
    wrapping each streamed chunk's ``send`` - and every other request by the FastAPI app.
    It uses only ASGI's public interface: the endpoint is the one its router registers,
    and the failures it answers are those the app's own handlers answer, by the same
    function (:meth:`gateway.apis.relay.Relay.error`)."""

    def __init__(self, app: FastAPI, path: str, endpoint: Endpoint) -> None:
        self.app, self.path, self.endpoint = app, path, endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app  # what Starlette sets for its routes, so ``request.app`` is the app
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except HANDLED as exc:  # any other failure: uvicorn answers 500, as Starlette's outermost layer would
            response = await self.app.state.relay.error(request, exc)
        await response(scope, receive, send)


def create_app(config: GatewayConfig) -> ASGIApp:
    gateway = assemble(config)
    access = open_access_log(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        if gateway.keys.open:
            log.warning(OPEN_WARNING)
        if gateway.keys.file is not None:  # SIGHUP: re-read it now, not at the next poll
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, gateway.keys.reload, True)
        # What exists now (modules, the app, its routes, the pools) lives as long as the
        # process: frozen out of the collector's sight, a full collection walks only what
        # requests made since. Unfrozen, each one stalled a loaded replica's event loop
        # every few seconds, and those stalls were the TTFT tail under load.
        gc.collect()
        gc.freeze()
        yield
        await gateway.stop()
        GatewayMetrics.process_exits()
        if access is not None:
            access.stop()

    app = FastAPI(title="ampd gateway", lifespan=lifespan)
    app.state.relay = relay = Relay(gateway, {MESSAGES_PATH: messages.error_body})
    app.state.responses = responses.ResponseStore(gateway.redis, config.key_prefix, config.session_ttl_s)
    app.openapi = lambda: _document(app)  # type: ignore[method-assign]
    for handled in HANDLED:
        app.add_exception_handler(handled, relay.error)

    async def routing_error(request: Request, exc: Exception) -> JSONResponse:
        response = await relay.error(request, routing_api_error(request, exc))
        response.headers.update(getattr(exc, "headers", None) or {})  # a 405's Allow
        return response

    app.add_exception_handler(HTTPException, routing_error)
    app.add_exception_handler(RequestValidationError, routing_error)
    for router in (chat.router, responses.router, messages.router, service.router):
        app.include_router(router)
    hot = HotPath(app, CHAT_PATH, chat.chat_completions)
    return hot if access is None else AccessLog(hot)


def routing_api_error(request: Request, exc: Exception) -> APIError:
    """What FastAPI's routing refused (an unknown path, a method the path does not take, a
    bad query parameter) as an error of the API the path belongs to, not FastAPI's
    ``{"detail": ...}``."""
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    assert isinstance(exc, HTTPException)
    asked = f"{request.method} {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return APIError(405, f"Method not allowed ({asked}); this path takes {allowed}", code="method_not_allowed")
    if exc.status_code == 404:
        return APIError(404, f"Invalid URL ({asked})", code="unknown_url")
    return APIError(exc.status_code, str(exc.detail))


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
    event loop is what saturates first: a host's cores go further as several replicas
    behind one port than as one."""
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


def app_from_environment() -> ASGIApp:
    """The app of one of several gateway processes sharing a port (``ampd gateway
    --processes``, uvicorn's workers): its configuration comes from the parent in
    ``AMPD_GATEWAY_CONFIG``, without a replica id - each process is a replica of its own,
    as replicas on different hosts are (they share their state in Redis). Each writes an
    access log of its own (gateway.access_log.per_process)."""
    config = GatewayConfig.model_validate_json(os.environ[CONFIG_ENV])
    config = config.model_copy(update={"access_log": per_process(config.access_log)})
    # A process of several ends with its parent, so a gateway stopped hard leaves no replica
    # serving that nobody can stop: uvicorn's parent waits for its workers, and a worker slow
    # to shut down once got its parent killed by the caller's deadline and stayed behind.
    end_with_parent(signal.SIGKILL)
    prepare_process(config, os.environ.get(OTLP_ENV))
    return create_app(config)


DOCUMENTED_BODIES = {  # the request bodies FastAPI cannot see: the routes read them themselves
    CHAT_PATH: ChatRequest,
    "/v1/responses": responses.ResponsesRequest,
    MESSAGES_PATH: messages.MessagesRequest,
    f"{MESSAGES_PATH}/count_tokens": messages.CountTokensRequest,
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
