"""What a simulation comes to: ``SimReport``, and ``summarise`` that makes it from a run.

The report carries every round's latencies (not dumped) so that a run can be judged
again by another SLO or ITL rule without simulating it again; the planner reads its
tau coefficients (Eq. 5) from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, Field

from perfmodel.slo import ITL_RULES, SLO, ItlRule

if TYPE_CHECKING:
    from planner.simulator.loop import Simulation


class RolesAt(BaseModel):
    """How many engines had each role from ``at`` on (elastic pools)."""

    at: float
    prefill: int
    decode: int
    mixed: int
    unified: int = 0


class LatencySummary(BaseModel):
    count: int
    mean_s: float | None
    p95_s: float | None


class WorkerUsage(BaseModel):
    worker_id: str
    role: str
    utilisation: float  # fraction of the run the worker was stepping
    preemptions: int


class SimReport(BaseModel):
    policy: str
    prefill: str
    decode: str
    gpus: int
    sessions: int
    rounds: int
    ttft_slo_s: float
    itl_slo_s: float
    ttft: LatencySummary
    ttft_initial: LatencySummary
    ttft_incremental: LatencySummary
    itl: LatencySummary  # of each round's mean inter-token gap
    itl_p95: LatencySummary  # of each round's 95th-percentile gap
    itl_max: LatencySummary  # of each round's longest gap
    prefill_phase: LatencySummary
    first_token_after_prefill: LatencySummary  # TTFT less the prefill phase: KV pull, admission, first step
    itl_rule: ItlRule = "mean"  # how a round's gaps are judged (perfmodel.slo)
    slo_attainment_rounds: float  # rounds meeting the TTFT threshold and, by the ITL rule, the ITL one
    slo_attainment_by_rule: dict[ItlRule, float]  # the same under every ITL rule
    slo_attainment_sessions: float  # sessions all of whose rounds did (by the ITL rule)
    local_share_incremental: float  # incremental prefills run on the decode worker
    local_share: float
    split_share: float = 0.0  # rounds whose prompt was split between two engines (rounds.split_point)
    makespan_s: float
    workers: list[WorkerUsage]
    wall_s: float = 0.0
    moves: int = 0  # role changes (elastic pools)
    roles: list[RolesAt] = []  # the pool's roles over time (elastic pools)
    # (TTFT, mean, P95, longest gap, its session's arrival) of every round, to judge the run by
    # another SLO; not dumped.
    round_latencies: list[tuple[float, float | None, float | None, float | None, float]] = Field(
        default=[], exclude=True
    )

    def round_itl(self, rule: ItlRule) -> LatencySummary:
        return {"mean": self.itl, "p95": self.itl_p95, "max": self.itl_max}[rule]

    def attainment(self, slo: SLO, rule: ItlRule) -> float:
        """The share of rounds meeting ``slo`` by ``rule``: the same run judged by another SLO.
        (A policy whose decisions read the SLO - ampd's - would have decided differently.)"""
        met = self.verdicts(slo, rule)
        return sum(met) / len(met) if met else 0.0

    def verdicts(self, slo: SLO, rule: ItlRule) -> list[bool]:
        """Whether each round met ``slo`` by ``rule``, in the order the rounds finished."""
        column = {"mean": 1, "p95": 2, "max": 3}[rule]
        return [slo.met(r[0], r[column]) for r in self.round_latencies]

    def by_minute(self, slo: SLO, rule: ItlRule) -> dict[int, tuple[int, int]]:
        """(rounds met, rounds) by the minute each round's session arrived in: the same rounds
        in every deployment that ran the trace, so their verdicts compare minute by minute."""
        out: dict[int, tuple[int, int]] = {}
        for r, met in zip(self.round_latencies, self.verdicts(slo, rule), strict=True):
            minute = int(r[4] // 60)
            done, n = out.get(minute, (0, 0))
            out[minute] = (done + met, n + 1)
        return out

    @property
    def tau_prefill(self) -> float | None:
        """P95 prefill-phase latency over TTFT_thres: the planner's tau_pre (Eq. 5)."""
        p95 = self.prefill_phase.p95_s
        return None if p95 is None else p95 / self.ttft_slo_s

    @property
    def tau_decode(self) -> float | None:
        """The planner's tau_dec (Eq. 5): the worse of P95 per-round ITL (by the ITL rule) over ITL_thres and
        P95 time from prefill to first token over TTFT_thres - a decode replica whose KV
        cache is full holds first tokens back while its ITL looks fine."""
        itl, first = self.round_itl(self.itl_rule).p95_s, self.first_token_after_prefill.p95_s
        if itl is None:
            return None
        return max(itl / self.itl_slo_s, (first or 0.0) / self.ttft_slo_s)


def _summary(values: Sequence[float]) -> LatencySummary:
    if not values:
        return LatencySummary(count=0, mean_s=None, p95_s=None)
    array = np.asarray(values)
    return LatencySummary(count=len(values), mean_s=float(array.mean()), p95_s=float(np.percentile(array, 95)))


def summarise(sim: Simulation, wall_s: float = 0.0) -> SimReport:
    """What ``sim``'s run comes to: its rounds' latencies and SLO attainment, by every ITL
    rule, and its workers' use (``wall_s``: the run's wall time, to report beside it)."""
    records, slo, rule = sim.records, sim.config.slo, sim.config.itl_rule
    met = [r.slo_met[rule] for r in records]
    by_session: dict[str, bool] = {}
    for record, ok in zip(records, met, strict=True):
        by_session[record.session_id] = by_session.get(record.session_id, True) and ok
    complete = {s.trace.session_id for s in sim.sessions if s.next_round == len(s.trace.rounds)}
    incremental = [r for r in records if r.incremental]
    arrival = {s.trace.session_id: s.trace.arrival_s for s in sim.sessions}
    start = min((s.trace.arrival_s for s in sim.sessions), default=0.0)
    makespan = max(sim.now - start, 1e-9)
    pools = f"{sim.config.prefill.label()}" if sim.prefillers and sim.config.prefill else "none"
    return SimReport(
        policy=sim.config.policy,
        prefill=pools,
        decode=sim.config.decode.label(),
        gpus=sim.config.decode.gpus + (sim.config.prefill.gpus if sim.prefillers and sim.config.prefill else 0),
        sessions=len(sim.sessions),
        rounds=len(records),
        ttft_slo_s=slo.ttft_s,
        itl_slo_s=slo.itl_s,
        ttft=_summary([r.ttft_s for r in records]),
        ttft_initial=_summary([r.ttft_s for r in records if not r.incremental]),
        ttft_incremental=_summary([r.ttft_s for r in incremental]),
        itl=_summary([r.mean_itl_s for r in records if r.mean_itl_s is not None]),
        itl_p95=_summary([r.p95_itl_s for r in records if r.p95_itl_s is not None]),
        itl_max=_summary([r.max_itl_s for r in records if r.max_itl_s is not None]),
        prefill_phase=_summary([r.prefill_s for r in records]),
        first_token_after_prefill=_summary([r.ttft_s - r.prefill_s for r in records]),
        itl_rule=rule,
        slo_attainment_rounds=sum(met) / len(met) if met else 0.0,
        slo_attainment_by_rule={
            r: sum(record.slo_met[r] for record in records) / len(records) if records else 0.0 for r in ITL_RULES
        },
        slo_attainment_sessions=(
            sum(1 for s, ok in by_session.items() if ok and s in complete) / len(sim.sessions) if sim.sessions else 0.0
        ),
        local_share_incremental=(
            sum(r.route == "local" for r in incremental) / len(incremental) if incremental else 0.0
        ),
        local_share=sum(r.route == "local" for r in records) / len(records) if records else 0.0,
        split_share=sum(r.split_at is not None for r in records) / len(records) if records else 0.0,
        makespan_s=makespan,
        workers=[
            WorkerUsage(
                worker_id=w.worker_id,
                role=w.assignment.role,
                utilisation=w.busy_s / makespan,
                preemptions=w.scheduler.num_preemptions,
            )
            for w in sim.workers.values()
        ],  # fmt: skip
        wall_s=wall_s,
        moves=len(sim.moves),
        roles=sim.timeline,
        round_latencies=[(r.ttft_s, r.mean_itl_s, r.p95_itl_s, r.max_itl_s, arrival[r.session_id]) for r in records],
    )
