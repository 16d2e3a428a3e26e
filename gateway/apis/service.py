"""The gateway's own routes: health, readiness, metrics, the models served, and a session's rounds."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.apis.relay import relay
from gateway.apis.schema import APIError
from gateway.state.outage import REDIS_DOWN

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready while a decode worker is known. Without Redis the replica still serves
    (gateway.state.outage), so it stays in rotation and says it is degraded. It names the
    replica (the process, where several share the port) that answered."""
    gateway = relay(request).gateway
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
            "replica": gateway.config.replica_id}  # fmt: skip
    return JSONResponse(body, status_code=200 if serving else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gateway = relay(request).gateway
    with contextlib.suppress(aioredis.RedisError, OSError):  # a Redis outage must not hide the rest
        gateway.metrics.sessions_active.set(await gateway.sessions.active())
    return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    gateway = relay(request).gateway
    gateway.authenticate(request.headers.get("authorization"))
    created = int(time.time())
    data = [{"id": m, "object": "model", "created": created, "owned_by": "ampd"} for m in gateway.pool.models()]
    return {"object": "list", "data": data}


@router.get("/v1/sessions/{session_id}")
async def session_rounds(session_id: str, request: Request) -> dict[str, Any]:
    """Every round of a session: route, queue wait, TTFT, ITL. Scoped to the caller's key,
    so another tenant's session id is simply not found."""
    gateway = relay(request).gateway
    scope = gateway.authenticate(request.headers.get("authorization"))
    session = await gateway.sessions.load(scope, session_id)
    if session is None:
        raise APIError(404, f"No session found with id '{session_id}'.", code="session_not_found")
    return {
        "id": session_id, "object": "session", "created": int(session.created),
        "decode_worker": session.state.decode_worker, "rounds": await gateway.sessions.rounds(scope, session_id),
    }  # fmt: skip
