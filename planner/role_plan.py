"""The elastic policy's plan: a pool of engines, and its split at each load.

The elastic controller (rounds.elastic) moves engines between the prefill and decode
roles as the forecast load moves. Which split serves a load best depends on the routing
- AMPD's decode engines prefill incremental rounds themselves, and the ITL rule decides
whether their stalls are allowed - more than on DOPD's balance of the two phases
("DOPD: A Dynamic PD-Disaggregation Architecture for Maximizing Goodput in LLM Inference
Serving", Eq. 14), so the planner measures it: for a pool of ``engines`` engines of one
TP degree, the simulator runs the trace's sessions respaced to each planned arrival rate
on every static split (``prefill`` engines in the prefill role, the rest decoding, routed
as the elastic policy routes them: ``ampd-tail``); each split's SLO attainment at each
load is the ``RolePlan`` the controller moves by.
Large pools try a ladder of splits (``split_ladder``) rather than every one.

``pools`` does it for every TP degree that fills the GPUs, and ``rank`` simulates the
elastic policy with each pool's plan on the trace itself, best first: that is
``ampd plan --policy elastic``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from planner.plan import Judging
from planner.simulator import SimConfig, SimReport
from planner.trace import TraceSession, respace, rounds_per_session
from rounds.elastic import RolePlan, RoleStep
from rounds.policies import POLICIES

STATIC = "ampd-tail"  # how the elastic policy routes within its roles (rounds.policies)
LEVELS = 6  # loads planned when none are given


@dataclass(frozen=True)
class SplitRun:
    """One static split of a pool, simulated at one load."""

    tp: int
    engines: int
    prefill: int
    rate: float  # sessions per second
    rounds_per_s: float  # the same load as the controller measures it
    config: SimConfig
    sessions: list[TraceSession]


def split_ladder(engines: int) -> list[int]:
    """The splits a pool tries: every one up to 8 engines, then 0-4 and every quarter."""
    if engines <= 8:
        return list(range(engines))
    return sorted({0, 1, 2, 3, 4, *(engines * q // 4 for q in (1, 2, 3))} - {engines})


def load_levels(sessions: Sequence[TraceSession], window_s: float = 60.0, levels: int = LEVELS) -> list[float]:
    """Session arrival rates that span the trace's load: quantiles of its rate over
    ``window_s`` windows (a stationary trace gives levels around its one rate)."""
    arrivals = np.array([s.arrival_s for s in sessions])
    span = float(arrivals.max() - arrivals.min())
    if span < 2 * window_s:
        mean = (len(arrivals) - 1) / span if span > 0 else 1.0
        return [round(mean * f, 4) for f in np.linspace(0.5, 1.5, levels)]
    edges = np.arange(arrivals.min(), arrivals.max(), window_s)
    counts = np.histogram(arrivals, bins=[*edges, arrivals.max()])[0][:-1] / window_s
    quantiles = np.quantile(counts[counts > 0], np.linspace(0.1, 1.0, levels))
    return sorted({round(float(q), 4) for q in quantiles if q > 0})


def opening_load(sessions: Sequence[TraceSession], window_s: float = 60.0) -> float:
    """Rounds per second the trace's first ``window_s`` brings (its sessions per second
    there, times the trace's rounds per session): the load a pool starts with."""
    first = min(s.arrival_s for s in sessions)
    opening = max(1, sum(1 for s in sessions if s.arrival_s < first + window_s)) / window_s
    return opening * rounds_per_session(sessions)


def split_runs(
    judging: Judging,
    sessions: Sequence[TraceSession],
    gpu: str,
    tp: int,
    engines: int,
    rates: Sequence[float],
    seed: int = 0,
) -> list[SplitRun]:
    rounds = rounds_per_session(sessions)
    runs = []
    for rate in rates:
        respaced = respace(list(sessions), rate, seed)
        for k in split_ladder(engines):
            config = split_config(judging, gpu, tp, engines, k, seed)
            runs.append(SplitRun(tp, engines, k, rate, rate * rounds, config, respaced))
    return runs


def split_config(judging: Judging, gpu: str, tp: int, engines: int, prefill: int, seed: int = 0) -> SimConfig:
    """The pool with ``prefill`` of its engines in the prefill role for good, routed as
    the elastic policy routes (``STATIC``, whatever ``judging``'s policy)."""
    decode = judging.pool(gpu, tp, engines - prefill)
    return judging.config(decode, judging.pool(gpu, tp, prefill) if prefill else None, policy=STATIC, seed=seed)


def role_plan(runs: Sequence[SplitRun], reports: Sequence[SimReport]) -> RolePlan:
    """Each load's splits and their SLO attainment, from one pool's ``runs`` and their reports."""
    if len({(r.tp, r.engines) for r in runs}) != 1:
        raise ValueError("a role plan is one pool's")
    steps: dict[float, dict[int, float]] = {}
    for run, report in zip(runs, reports, strict=True):
        steps.setdefault(round(run.rounds_per_s, 4), {})[run.prefill] = round(report.slo_attainment_rounds, 4)
    return RolePlan(tuple(RoleStep(rate, splits) for rate, splits in sorted(steps.items())))


@dataclass(frozen=True)
class PoolPlan:
    tp: int
    engines: int
    plan: RolePlan
    predicted: SimReport | None = None  # the elastic policy with this plan, on the trace


def pools(
    judging: Judging,
    sessions: Sequence[TraceSession],
    gpu: str,
    gpus: int,
    rates: Sequence[float],
    run: Callable[[Sequence[SimConfig], Sequence[Sequence[TraceSession]]], list[SimReport]],
    seed: int = 0,
) -> list[PoolPlan]:
    """A plan for every pool of one TP degree that fills ``gpus`` (a pool of one engine
    has one split: colocated); ``run`` simulates configs on their sessions (in parallel,
    where the caller can)."""
    book = judging.book
    shapes = [(tp, gpus // tp) for tp in book.feasible(gpu) if gpus % tp == 0]
    if not shapes:
        raise ValueError(f"no TP degree of {book.model.name} on {gpu} divides {gpus} GPUs")
    runs = [split_runs(judging, sessions, gpu, tp, n, rates, seed) for tp, n in shapes]
    flat = [r for pool in runs for r in pool]
    reports = run([r.config for r in flat], [r.sessions for r in flat])
    out, at = [], 0
    for (tp, n), pool in zip(shapes, runs, strict=True):
        out.append(PoolPlan(tp, n, role_plan(pool, reports[at : at + len(pool)])))
        at += len(pool)
    return out


def elastic_config(judging: Judging, gpu: str, pool: PoolPlan, start_load: float, seed: int = 0) -> SimConfig:
    """``judging``'s policy, an elastic one, on ``pool``, starting with the split planned
    for ``start_load`` rounds per second."""
    if POLICIES[judging.policy].elastic is None:
        raise ValueError(f"a role plan steers an elastic policy, not {judging.policy!r}")
    engines = judging.pool(gpu, pool.tp, pool.engines)
    return judging.config(engines, None, seed=seed, initial_prefill=pool.plan.target(start_load), role_plan=pool.plan)


def rank(
    judging: Judging,
    sessions: Sequence[TraceSession],
    gpu: str,
    gpus: int,
    run: Callable[[Sequence[SimConfig], Sequence[Sequence[TraceSession]]], list[SimReport]],
    seed: int = 0,
) -> list[PoolPlan]:
    """Every pool planned at ``sessions``' loads, then ``judging``'s elastic policy simulated
    on ``sessions`` with each plan: best first (attainment, then P95 TTFT)."""
    planned = pools(judging, sessions, gpu, gpus, load_levels(sessions), run, seed)
    start = opening_load(sessions)
    configs = [elastic_config(judging, gpu, p, start, seed) for p in planned]
    reports = run(configs, [sessions] * len(configs))
    ranked = [replace(p, predicted=r) for p, r in zip(planned, reports, strict=True)]
    return sorted(ranked, key=lambda p: (-p.predicted.slo_attainment_rounds, p.predicted.ttft.p95_s or 0.0))
