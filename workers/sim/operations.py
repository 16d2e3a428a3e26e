"""The operational routes: ``GET /health`` (and ``/ping``), ``/version``, ``/v1/models``, ``/metrics``,
and ``POST /reset_prefix_cache`` (vLLM's, served there with VLLM_SERVER_DEV_MODE)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from workers.sim import protocol as p
from workers.sim.worker import WorkerDep

router = APIRouter()


@router.get("/health")
@router.get("/ping")
async def health(w: WorkerDep) -> Response:
    return Response(status_code=200 if w.engine.alive else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": p.SYSTEM_FINGERPRINT_PREFIX}


@router.get("/v1/models")
async def models(w: WorkerDep) -> dict[str, Any]:
    created = int(asyncio.get_running_loop().time())
    name = w.config.model_name
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": w.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{secrets.token_hex(8)}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


@router.get("/metrics")
async def metrics(w: WorkerDep) -> Response:
    return Response(generate_latest(w.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(w: WorkerDep) -> dict[str, bool]:
    """Drop every cached block's hash; refused (``success: false``) while any block is in use,
    as vLLM's (vllm/entrypoints/serve/dev/cache/api_router.py). Its event goes out at once."""
    success = w.scheduler.kv.reset_prefix_cache()
    await w.engine.publish_kv_events()
    return {"success": success}
