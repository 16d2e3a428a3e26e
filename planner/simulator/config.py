"""The deployment a simulation runs: its pools and the policy's knobs (planner.simulator)."""

from __future__ import annotations

from dataclasses import dataclass

from perfmodel.profile import Profile
from perfmodel.slo import ALPHA, BETA, SLO, ItlRule
from rounds.elastic import RolePlan
from rounds.engine.scheduler import SchedulerConfig
from rounds.placement import Placement


@dataclass(frozen=True)
class Pool:
    """``replicas`` workers of one profile (its TP degree is the profile's)."""

    profile: Profile
    replicas: int

    @property
    def gpus(self) -> int:
        return self.profile.tp * self.replicas

    def label(self) -> str:
        return f"TP={self.profile.tp}, DP={self.replicas} on {self.profile.gpu.name}"


@dataclass(frozen=True)
class SimConfig:
    decode: Pool
    prefill: Pool | None
    slo: SLO
    policy: str = "ampd"
    placement: Placement = "memory"  # where sessions bind and remote prefills go (rounds.placement)
    alpha: float = ALPHA
    beta: float = BETA
    window: int = 3
    stats_window_s: int = 10
    prefill_slots: int = 1
    seed: int = 0
    itl_rule: ItlRule = "mean"  # how rounds are judged (perfmodel.slo)
    scheduler: SchedulerConfig = SchedulerConfig()
    decode_prefill_chunk: int = 0  # decode workers' long_prefill_token_threshold (0: no cap)
    initial_prefill: int = 0  # an elastic pool (``decode``, no ``prefill``): engines that start as prefill
    role_plan: RolePlan | None = None  # an elastic pool's planned split by load (rounds.elastic)
    max_decode_steps: int = 64  # fused decode steps per event; results do not depend on it
