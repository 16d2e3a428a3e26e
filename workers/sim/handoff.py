"""The serving half of the KV side channel: the routes a peer's ``KVSideChannel``
(workers.sim.kv_transfer, which documents the protocol) handshakes with and reads from."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from workers.sim import protocol as p
from workers.sim.worker import WorkerDep

router = APIRouter()


class KVRead(BaseModel):
    request_id: str
    block_ids: list[int]


@router.get("/kv/handshake")
async def kv_handshake(w: WorkerDep) -> dict[str, Any]:
    return {
        "engine_id": w.config.engine_id,
        "block_size": w.scheduler.kv.block_size,
        "profile": w.config.profile.model_dump(mode="json"),
        "node": w.config.node_name,
    }


@router.post("/kv/read")
async def kv_read(read: KVRead, w: WorkerDep) -> dict[str, Any]:
    blocks = w.scheduler.read_held(read.request_id, read.block_ids)
    if blocks is None:
        raise p.EngineError(404, f"no KV held for {read.request_id} with those blocks", "NotFoundError")
    w.engine.release_transfer(read.request_id)
    return {"blocks": blocks}
