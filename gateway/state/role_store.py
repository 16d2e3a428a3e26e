"""Engine roles in Redis, shared by every gateway replica (rounds.roles says what they mean).

``{p}:role:{w}`` is a hash (role, since, draining; and the step target an engine's
scheduler keeps to, gateway.engines.step_targets) per engine. The elastic controller's
leader writes it when it moves an engine, an operator with ``ampd workers set``; every
replica reads the roles with its pool refresh, so a move reaches all of them within a
refresh interval and needs no restart of anything. An engine with no hash keeps the
role it registered with (a ``both`` engine decodes and takes remote prefills, as it
always has); only engines registered as ``both`` - vLLM's ``kv_both`` connector - can
change role.

``{p}:elastic:leader`` is the lease of the replica whose controller decides the moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from gateway.state import scripts
from rounds.roles import ROLES, Assignment
from surface.registry import role_key

LEADER_TTL_S = 3.0


class RoleStore:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis, self.p = redis, prefix
        self._lease = redis.register_script(scripts.LEASE)

    def _key(self, worker_id: str) -> str:
        return role_key(self.p, worker_id)

    async def load(self, worker_ids: Sequence[str]) -> dict[str, Assignment]:
        """The assigned roles of these engines (those with none are left out)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for w in worker_ids:
                pipe.hgetall(self._key(w))
            found = await pipe.execute()
        out = {}
        for worker_id, fields in zip(worker_ids, found, strict=True):
            if fields.get("role") in ROLES:
                draining = fields.get("draining") or None
                out[worker_id] = Assignment(worker_id, fields["role"], float(fields.get("since", 0)), draining)
        return out

    async def save(self, assignment: Assignment) -> None:
        await self.redis.hset(
            self._key(assignment.worker_id),
            mapping={"role": assignment.role, "since": repr(assignment.since), "draining": assignment.draining or ""},
        )

    async def lead(self, replica_id: str) -> bool:
        """Take or keep the controller's lease; True while this replica holds it."""
        return bool(await self._lease(keys=[f"{self.p}:elastic:leader"], args=[replica_id, int(LEADER_TTL_S * 1000)]))
