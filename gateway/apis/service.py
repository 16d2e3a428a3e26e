"""The gateway's own routes: health, readiness, metrics, the models served, and a session's rounds."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from gateway.apis.relay import relay
from gateway.apis.schema import APIError
from gateway.engines.kv_index import cached_tokens
from gateway.state.outage import REDIS_DOWN

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready while a decode worker is known. Without Redis the replica still serves
    (gateway.state.outage), so it stays in rotation and says it is degraded. It names the
    replica (the process, where several share the port) that answered, the workers it knows
    and which of them drain (offered no new session or round), and whether sessions are
    tenant-scoped (``"tenancy": "keys"``) or shared by every caller (``"open"``)."""
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
    draining = sorted(w for w, live in gateway.pool.workers.items() if live.info.draining)
    body = {"status": status, "problems": problems, "workers": sorted(gateway.pool.workers), "draining": draining,
            "replica": gateway.config.replica_id, "tenancy": "open" if gateway.keys.open else "keys"}  # fmt: skip
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
    names = dict.fromkeys([*gateway.config.served_model_names, *gateway.pool.models()])  # the served names first
    data = [{"id": m, "object": "model", "created": created, "owned_by": "ampd"} for m in names]
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


class IndexQuery(BaseModel):
    """A prompt as the index is asked about it: its token ids, and vLLM's cache salt."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[StrictInt] = Field(default_factory=list, max_length=1_000_000)
    cache_salt: StrictStr | None = None


@router.post("/v1/engines/kv-index")
async def kv_index(request: Request, query: IndexQuery) -> dict[str, Any]:
    """What this replica's KV index (gateway.engines.kv_index) says each engine holds:
    its blocks, its block size, and - for the body's ``token_ids`` (and ``cache_salt``) -
    the prompt tokens it would take from its prefix cache. For operators and tests."""
    gateway = relay(request).gateway
    gateway.authenticate(request.headers.get("authorization"))
    views = gateway.kv.index.engines
    cached = cached_tokens(gateway.kv.index, gateway.kv.hashing(views), query.token_ids, query.cache_salt)
    engines = {engine: {"blocks": len(view.blocks), "block_size": view.block_size, "cached_tokens": cached.get(engine)}
               for engine, view in views.items()}  # fmt: skip
    return {"object": "kv_index", "replica": gateway.config.replica_id, "engines": engines}
