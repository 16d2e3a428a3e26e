"""Step targets handed to engines: the gateway's policy decides them, the registry carries them.

A policy that sizes steps (rounds.policies.step_target: DynaServe's local scheduler,
"DynaServe: Unified and Elastic Execution for Dynamic Disaggregated LLM Serving",
section 4.2) keeps each engine it uses to a target derived from the ITL SLO of that
engine's profile. After every pool refresh each replica writes that target into the
registry (surface.registry.set_step_target_ms) for every engine whose scheduler follows
one (``WorkerInfo.sized_steps``: the GPU-free engine, and vLLM under ampd's scheduler)
and holds another; the engine applies it within a second (surface.registry.
follow_step_target), without a restart. Replicas of one deployment compute the same
target, so their writes agree.

The target does not depend on the engine's role: it binds only while requests decode on
the engine, so a prefill-only engine's steps stay whole, and a role move (rounds.roles)
needs no new target - the simulator likewise runs every engine with one target. A policy
that sizes no steps assigns nothing and leaves an operator's ``ampd workers step-target``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import redis.asyncio as aioredis

from gateway.config import GatewayConfig
from gateway.state.outage import REDIS_DOWN
from rounds.policies import step_target_ms
from surface.registry import WorkerInfo, set_step_target_ms, step_targets_ms

log = logging.getLogger(__name__)


def wanted_ms(config: GatewayConfig, info: WorkerInfo) -> float:
    """The target the gateway's policy keeps this engine to (0: none), from the SLO its
    rounds are judged by there."""
    return step_target_ms(config.policy, config.slo(info.profile, info.speed), config.itl_slo_metric, config.beta)


def to_assign(wanted: Mapping[str, float], held: Mapping[str, float]) -> dict[str, float]:
    """The targets to write: ``wanted`` holds, per engine that follows one, the target the
    policy wants (0: none); each that holds another gets it. Pure: no I/O."""
    return {worker_id: target for worker_id, target in wanted.items() if target > 0 and held.get(worker_id) != target}


class StepTargets:
    def __init__(self, redis: aioredis.Redis, config: GatewayConfig) -> None:
        self.redis, self.config = redis, config

    async def assign(self, workers: Iterable[WorkerInfo]) -> None:
        """Write what :func:`to_assign` says; with Redis away, the engines keep theirs."""
        wanted = {info.worker_id: wanted_ms(self.config, info) for info in workers if info.sized_steps}
        following = [w for w, target in wanted.items() if target > 0]
        if not following:
            return
        prefix = self.config.key_prefix
        try:
            held = await step_targets_ms(self.redis, prefix, following)
            for worker_id, target in to_assign(wanted, held).items():
                await set_step_target_ms(self.redis, prefix, worker_id, target)
                log.info("engine %s: step target %.1f ms (%s)", worker_id, target, self.config.policy)
        except REDIS_DOWN as exc:
            log.info("step targets not assigned: %r", exc)
