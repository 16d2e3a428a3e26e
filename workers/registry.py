"""The worker registry in Redis: workers announce themselves, gateways read the list.

A worker (GPU-free or vLLM) writes one hash, ``{prefix}:worker:{id}``, with its role,
address, model, profile and KV capacity, and keeps it alive by refreshing a TTL; a
worker that stops heartbeating drops out when the TTL lapses. Gateways list the
live ones. Statically configured workers never touch Redis (see gateway.config).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import Literal

import redis.asyncio as aioredis

from planner.profile import Profile

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
HEARTBEAT_TTL_S = 10.0


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: Role
    url: str
    model: str
    profile: Profile
    speed: float = 1.0
    kv_capacity_tokens: int = 0

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")

    def to_redis(self) -> dict[str, str]:
        fields = asdict(self)
        fields["profile"] = self.profile.model_dump_json()
        return {k: str(v) for k, v in fields.items()}

    @classmethod
    def from_redis(cls, fields: dict[str, str]) -> WorkerInfo:
        return cls(
            worker_id=fields["worker_id"],
            role=fields["role"],  # type: ignore[arg-type]
            url=fields["url"],
            model=fields["model"],
            profile=Profile.model_validate(json.loads(fields["profile"])),
            speed=float(fields["speed"]),
            kv_capacity_tokens=int(fields["kv_capacity_tokens"]),
        )


def _key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:worker:{worker_id}"


def _index(prefix: str) -> str:
    return f"{prefix}:workers"


async def register(redis: aioredis.Redis, prefix: str, info: WorkerInfo, ttl_s: float = HEARTBEAT_TTL_S) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(_key(prefix, info.worker_id), mapping=info.to_redis())
        pipe.pexpire(_key(prefix, info.worker_id), int(ttl_s * 1000))
        pipe.sadd(_index(prefix), info.worker_id)
        await pipe.execute()


async def deregister(redis: aioredis.Redis, prefix: str, worker_id: str) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(_key(prefix, worker_id))
        pipe.srem(_index(prefix), worker_id)
        await pipe.execute()


async def live_workers(redis: aioredis.Redis, prefix: str) -> list[WorkerInfo]:
    """Every worker whose heartbeat has not lapsed (lapsed ones leave the index)."""
    ids = sorted(await redis.smembers(_index(prefix)))
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(_key(prefix, worker_id))
        records = await pipe.execute()
    gone = [w for w, fields in zip(ids, records, strict=True) if not fields]
    if gone:
        await redis.srem(_index(prefix), *gone)
    return [WorkerInfo.from_redis(fields) for fields in records if fields]


async def heartbeat(redis: aioredis.Redis, prefix: str, info: WorkerInfo, ttl_s: float = HEARTBEAT_TTL_S) -> None:
    """Register, then keep the registration alive until cancelled; deregister on the way out.

    Redis being away is logged and retried: the worker keeps serving, and its entry
    comes back with the next heartbeat that reaches Redis.
    """
    try:
        while True:
            try:
                await register(redis, prefix, info, ttl_s)
            except (aioredis.RedisError, OSError) as exc:
                log.warning("heartbeat to Redis failed: %s", exc)
            await asyncio.sleep(ttl_s / 3)
    finally:
        with contextlib.suppress(aioredis.RedisError, OSError):
            await asyncio.shield(deregister(redis, prefix, info.worker_id))
