"""The worker registry in Redis: workers announce themselves, gateways read the list.

A worker (GPU-free or vLLM) writes one hash, ``{prefix}:worker:{id}``, with its role,
address, model, profile and KV capacity, and keeps it alive by refreshing a TTL; a
worker that stops heartbeating drops out when the TTL lapses. Gateways list the
live ones. A worker that is shutting down marks itself ``draining``: gateways bind no
new session to it and send it no new round, while the streams it serves finish.
Statically configured workers never touch Redis (see gateway.config).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from perfmodel.profile import Profile
from surface.redis_address import RedisAddress, follow_primary

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
HEARTBEAT_TTL_S = 10.0
NODE_ENV = "AMPD_NODE"
# After a failed beat, try again soon rather than a third of the TTL later: a Redis that
# comes back empty (restarted) should list the worker again within a moment.
RETRY_AFTER_FAILURE_S = 0.25
STEP_TARGET_POLL_S = 1.0  # how soon an assigned step target reaches an engine's scheduler


def heartbeat_client(url: str) -> aioredis.Redis:
    """A client for ``Registration`` that retries a call once, at once (a connection that a
    Redis restart or failover left stale), and otherwise leaves retrying to the heartbeat
    loop: redis-py's default tries ten times with back-off, each try waiting up to its
    socket timeout. ``url`` as surface.redis_address reads it."""
    return RedisAddress.parse(url).async_client(decode_responses=True, retry=Retry(NoBackoff(), 1))


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: Role
    url: str
    model: str
    profile: Profile
    speed: float = 1.0
    kv_capacity_tokens: int = 0
    draining: bool = False
    prefill_chunk: int = 0  # tokens of one request it prefills a step at most (vLLM's long_prefill_token_threshold)
    splits: bool = False  # prefills a prompt's head alone (``split_at``): DynaServe's micro-requests
    node: str = ""  # the server it runs on (node_name): KV moves over the server's GPU interconnect within one
    sized_steps: bool = False  # its scheduler keeps to the step target assigned here (follow_step_target)
    # Its KV events (surface.kv_events): the PUB and replay (ROUTER) endpoints, "" if off, and
    # how its block hashes are made, so that a gateway hashes a prompt's tokens as it does.
    kv_events: str = ""
    kv_events_replay: str = ""
    kv_hash_algo: str = ""
    kv_hash_seed: str = ""
    # Its step-sizing scheduler's correction of the profile's prefill prices (measured /
    # predicted, perfmodel.step_correction), which gateways price its prefills with.
    prefill_factor: float = 1.0

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
            draining=fields.get("draining") == "True",
            prefill_chunk=int(fields.get("prefill_chunk", 0)),
            splits=fields.get("splits") == "True",
            node=fields.get("node", ""),
            sized_steps=fields.get("sized_steps") == "True",
            kv_events=fields.get("kv_events", ""),
            kv_events_replay=fields.get("kv_events_replay", ""),
            kv_hash_algo=fields.get("kv_hash_algo", ""),
            kv_hash_seed=fields.get("kv_hash_seed", ""),
            prefill_factor=float(fields.get("prefill_factor", 1.0)),
        )


def node_name(advertise_host: str) -> str:
    """The server an engine runs on, as gateways compare it: ``AMPD_NODE`` where the
    deployment names it (Kubernetes' node name; one GPU host's containers under compose),
    else the host it is reached at."""
    return os.environ.get(NODE_ENV) or advertise_host


def reachable_host(listen_host: str) -> str:
    """The address peers should use for a server listening on ``listen_host``: itself,
    unless that is a wildcard, then this machine's own (a container's, under compose)."""
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    return socket.gethostbyname(socket.gethostname())


def _key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:worker:{worker_id}"


def _index(prefix: str) -> str:
    return f"{prefix}:workers"


def role_key(prefix: str, worker_id: str) -> str:
    """An engine's assignment (gateway.state.role_store): its role, and the step target its
    scheduler keeps to (``step_target_ms``), which the engine's supervisor follows."""
    return f"{prefix}:role:{worker_id}"


async def step_targets_ms(redis: aioredis.Redis, prefix: str, worker_ids: list[str]) -> dict[str, float]:
    """The step targets assigned to these engines (those with none are left out)."""
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in worker_ids:
            pipe.hget(role_key(prefix, worker_id), "step_target_ms")
        values = await pipe.execute()
    return {w: float(v) for w, v in zip(worker_ids, values, strict=True) if v not in (None, "")}


async def set_step_target_ms(redis: aioredis.Redis, prefix: str, worker_id: str, target_ms: float) -> None:
    await redis.hset(role_key(prefix, worker_id), "step_target_ms", repr(float(target_ms)))


async def follow_step_target(
    redis: aioredis.Redis, prefix: str, worker_id: str, apply: Callable[[float], None], initial_ms: float
) -> None:
    """Hand the step target assigned in the registry (by a gateway whose policy sizes steps,
    gateway.engines.step_targets, or by `ampd workers step-target`) to the engine's scheduler
    with ``apply``, without a restart; until one is assigned the engine keeps ``initial_ms``.
    A Redis away leaves the last target in place."""
    current = initial_ms
    while True:
        try:
            async with asyncio.timeout(5 * STEP_TARGET_POLL_S):
                assigned = (await step_targets_ms(redis, prefix, [worker_id])).get(worker_id)
        except (aioredis.RedisError, OSError) as exc:  # TimeoutError is an OSError
            log.warning("reading the step target from Redis failed: %r", exc)
            assigned = None
        if assigned is not None and assigned != current:
            apply(assigned)
            log.info("step target %.1f ms (was %.1f)", assigned, current)
            current = assigned
        await asyncio.sleep(STEP_TARGET_POLL_S)


def tokenizer_key(prefix: str, model: str) -> str:
    """A served model's tokenizer files, one key per model name."""
    return f"{prefix}:tokenizer:{model}"


async def publish_tokenizer(redis: aioredis.Redis, prefix: str, model: str, files: dict[str, Any]) -> bool:
    """Write a served model's tokenizer files for gateways to count its prompts with
    (gateway.engines.model_tokenizer), before the engine registers; whether they landed.
    ``files``: ``tokenizer`` (tokenizer.json's text), ``config`` (tokenizer_config.json)
    and ``chat_template`` (its text, or None). An engine whose files did not land serves all
    the same: gateways ask its ``/tokenize``."""
    try:
        await redis.set(tokenizer_key(prefix, model), json.dumps(files))
    except (aioredis.RedisError, OSError) as exc:
        log.warning("%s: tokenizer files not published (%r)", model, exc)
        return False
    return True


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


class Registration:
    """A worker's entry, kept alive by ``run`` until cancelled and removed on the way out.

    Redis being away is logged and retried: the worker keeps serving, and its entry
    comes back with the next heartbeat that reaches Redis.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str, info: WorkerInfo, ttl_s: float = HEARTBEAT_TTL_S) -> None:
        self.redis, self.prefix, self.info, self.ttl_s = redis, prefix, info, ttl_s

    async def run(self) -> None:
        try:
            while True:
                landed = await self._beat()
                await asyncio.sleep(self.ttl_s / 3 if landed else RETRY_AFTER_FAILURE_S)
        finally:
            # A frozen Redis must not hold up the worker's shutdown: past the TTL the entry
            # has lapsed anyway. TimeoutError is an OSError.
            with contextlib.suppress(aioredis.RedisError, OSError):
                async with asyncio.timeout(self.ttl_s):
                    await asyncio.shield(deregister(self.redis, self.prefix, self.info.worker_id))

    async def drain(self) -> None:
        """Announce now, not at the next beat, that this worker takes no new work."""
        self.info = replace(self.info, draining=True)
        await self._beat()

    async def _beat(self) -> bool:
        """Whether the entry reached Redis. A try is cut off after a quarter of the TTL, so
        a slow Redis still leaves time for the next one before the entry lapses."""
        try:
            async with asyncio.timeout(self.ttl_s / 4):
                await follow_primary(self.redis)  # after a switch-over, beat where gateways read
                await register(self.redis, self.prefix, self.info, self.ttl_s)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("heartbeat to Redis failed: %s", exc)
            return False
        except Exception:  # a client-library fault must not end the loop and deregister a live worker
            log.exception("heartbeat to Redis failed unexpectedly")
            return False
        return True
