"""The deployment planner's integer program: TP and DP per phase, AMPD Eq. (5).

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 5,
Eq. (5)) picks, for a fixed GPU budget, how many prefill replicas x^(n) and decode replicas y^(n) of each model-parallel
degree n to run so that the worst P95 latency Z over all deployed replicas is minimal:

    min Z  s.t.  (C1) Z >= tau_pre(n) where x^(n) >= 1,  (C2) Z >= tau_dec(n) where y^(n) >= 1,
                 (C3) sum_n n x^(n) + sum_n n y^(n) <= N.

The latency coefficients come from the simulator and are constants here. The paper
solves it with SCIP (section 6); so do we, through pyscipopt. Two extensions:

* GPU types. As in the multi-vendor P/D paper ("Disaggregated Prefill and Decoding
  Inference System for Large Language Model Serving on Multi-Vendor GPUs"), a phase
  may run on a different GPU type than the other phase, so (C3) holds per type: each
  type has its own capacity.
* Load-dependent tau. In the paper tau(n) is "the P95 latency of a single replica with
  degree n"; that latency depends on the load the replica gets, which is the trace's load
  divided among the phase's replicas. The simulator therefore gives tau per (GPU type,
  degree, replica count), and one such tuple is a `PoolOption`.

Because tau is measured with the phase's pool homogeneous (every replica the same degree
on the same type, each getting 1/m of the load), the program provisions each phase as
exactly one option: a mixed-degree pool would change every replica's load share, which
is not linear in x and y, and the simulator never measured it. The configurations the
paper reports (Table 2) are all homogeneous per phase, too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Literal

from pyscipopt import Model, quicksum

log = logging.getLogger(__name__)

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, Phase] = ("prefill", "decode")


@dataclass(frozen=True)
class PoolOption:
    """One way to provision a phase: `replicas` replicas of TP degree `tp` on GPU type `gpu`.

    `tau` is the simulated P95 latency of one replica in such a pool (the trace's load for
    the phase spread over `replicas`), divided by the phase's SLO, so 1.0 means "at the SLO".
    It is the coefficient tau_pre(n) or tau_dec(n) of AMPD's Eq. (5) (section 5) for that
    replica count; `gpu` names a type of a heterogeneous cluster (the multi-vendor P/D paper).
    """

    phase: Phase
    gpu: str
    tp: int
    replicas: int
    tau: float

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {self.phase!r}")
        if self.tp < 1 or self.replicas < 1:
            raise ValueError(f"tp and replicas must be >= 1: {self}")
        # A saturated configuration should reach the planner as a large finite tau (the
        # simulator's P95 over a finite trace is finite); inf or NaN has no rank to compare.
        if not math.isfinite(self.tau) or self.tau < 0:
            raise ValueError(f"tau must be finite and >= 0: {self}")

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    @property
    def pool(self) -> tuple[str, int]:
        """The (GPU type, degree) this option fills: the index of x or y in Eq. (5)."""
        return (self.gpu, self.tp)


@dataclass(frozen=True)
class Deployment:
    """One prefill pool and one decode pool; `z` is max of their taus, the Eq. (5) objective."""

    prefill: PoolOption
    decode: PoolOption
    z: float

    @classmethod
    def of(cls, prefill: PoolOption, decode: PoolOption) -> Deployment:
        return cls(prefill, decode, max(prefill.tau, decode.tau))

    def gpus_by_type(self) -> dict[str, int]:
        """GPUs used per GPU type, both phases together (what (C3) bounds per type)."""
        used: dict[str, int] = {}
        for option in (self.prefill, self.decode):
            used[option.gpu] = used.get(option.gpu, 0) + option.gpus
        return used

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    @property
    def key(self) -> tuple[float, float, int]:
        return objective_key(self.prefill, self.decode)


def objective_key(prefill: PoolOption, decode: PoolOption) -> tuple[float, float, int]:
    """The order of deployments, best first (smallest): the one definition `solve` and
    `enumerate_deployments` share.

    1. Z = max(tau_pre, tau_dec), the objective of AMPD's Eq. (5) (section 5): the
       bottleneck phase's normalised P95 latency.
    2. Tie-break: between pairs with the same bottleneck, the one whose other phase is
       faster (more headroom where Z does not look). With Z equal this is the same order as
       tau_pre + tau_dec, but compares the taus themselves, so no rounding of a sum enters.
    3. Tie-break: among pairs still equal, the one with fewer GPUs.

    The order is strictly lexicographic: no amount of 2 or 3 outweighs any difference in Z.
    """
    return (max(prefill.tau, decode.tau), min(prefill.tau, decode.tau), prefill.gpus + decode.gpus)


@dataclass(frozen=True)
class SolveStats:
    """What `solve_with_stats` did: the model's size (constraints include the no-good cuts added)
    and each solve's wall time and SCIP status ("optimal" when proven)."""

    variables: int
    constraints: int
    seconds: tuple[float, ...]
    statuses: tuple[str, ...]


def solve(
    options: Sequence[PoolOption], capacity: Mapping[str, int], top: int = 3, time_limit_s: float = 60.0
) -> list[Deployment]:
    """The `top` best deployments by `objective_key`, best first, found with SCIP.

    Implements AMPD's Eq. (5) (section 5) with one capacity per GPU type (the
    multi-vendor P/D paper). A GPU type missing from `capacity` has capacity 0, so
    options on it are never chosen. Returns fewer than `top` when fewer distinct
    (prefill, decode) pairs fit, or when `time_limit_s` (for all solves together) runs out.
    Raises ValueError when a phase has no option, when no option of a phase fits its
    GPU type's capacity, or when no prefill option fits together with a decode option.
    """
    return solve_with_stats(options, capacity, top, time_limit_s)[0]


def solve_with_stats(
    options: Sequence[PoolOption], capacity: Mapping[str, int], top: int = 3, time_limit_s: float = 60.0
) -> tuple[list[Deployment], SolveStats]:
    """`solve`, and what it cost (for the planning-time benchmark, AMPD appendix A.2)."""
    if top < 1:
        raise ValueError(f"top must be >= 1, not {top}")
    by_phase = _validate(options, capacity)
    program = _Program(by_phase, capacity)
    deadline = time.monotonic() + time_limit_s
    found: list[Deployment] = []
    seconds: list[float] = []
    statuses: list[str] = []
    while len(found) < top:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            log.warning(
                "planner ILP: %.1f s time limit reached after %d of %d deployments", time_limit_s, len(found), top
            )
            break
        started = time.perf_counter()
        pair, status = program.solve_next(remaining)
        seconds.append(time.perf_counter() - started)
        statuses.append(status)
        if pair is None:
            break
        if status != "optimal":
            log.warning(
                "planner ILP: deployment #%d is SCIP's best within the time limit, not proven best", len(found) + 1
            )
        found.append(Deployment.of(*pair))
    if not found and statuses and statuses[0] == "infeasible":
        raise ValueError(_no_pair_message(capacity))
    # Proven-optimal answers come in key order already; one cut short by the time limit may not.
    found.sort(key=lambda d: d.key)
    stats = SolveStats(program.model.getNVars(), program.model.getNConss(), tuple(seconds), tuple(statuses))
    return found, stats


def enumerate_deployments(options: Sequence[PoolOption], capacity: Mapping[str, int]) -> list[Deployment]:
    """Every (prefill, decode) pair within capacity, best first by `objective_key`: the brute force.

    Same validation and errors as `solve`; equal keys keep the options' input order.
    """
    by_phase = _validate(options, capacity)
    fitting = [Deployment.of(p, d) for p, d in product(by_phase["prefill"], by_phase["decode"])]
    fitting = [d for d in fitting if _fits(d, capacity)]
    if not fitting:
        raise ValueError(_no_pair_message(capacity))
    fitting.sort(key=lambda d: d.key)
    return fitting


def _fits(deployment: Deployment, capacity: Mapping[str, int]) -> bool:
    return all(used <= capacity.get(gpu, 0) for gpu, used in deployment.gpus_by_type().items())


def _validate(options: Sequence[PoolOption], capacity: Mapping[str, int]) -> dict[Phase, list[PoolOption]]:
    """Options per phase, after the checks that give a clearer error than an infeasible model."""
    for gpu, count in capacity.items():
        if count < 0:
            raise ValueError(f"capacity of GPU type {gpu!r} is negative: {count}")
    seen: set[tuple[str, str, int, int]] = set()
    for o in options:
        # Two taus for the same pool would leave the program to pick one arbitrarily.
        ident = (o.phase, o.gpu, o.tp, o.replicas)
        if ident in seen:
            raise ValueError(f"two options for the {o.phase} pool {o.replicas} x TP{o.tp} on {o.gpu}")
        seen.add(ident)
    by_phase: dict[Phase, list[PoolOption]] = {phase: [o for o in options if o.phase == phase] for phase in PHASES}
    for phase, phase_options in by_phase.items():
        if not phase_options:
            raise ValueError(f"no {phase} option given: the planner needs at least one per phase")
        if not any(o.gpus <= capacity.get(o.gpu, 0) for o in phase_options):
            smallest = min(phase_options, key=lambda o: o.gpus)
            raise ValueError(
                f"no {phase} option fits within capacity {dict(capacity)}: the smallest needs "
                f"{smallest.gpus} x {smallest.gpu} (a GPU type without a capacity entry has none)"
            )
    return by_phase


def _no_pair_message(capacity: Mapping[str, int]) -> str:
    return (
        f"no prefill option fits together with any decode option within capacity {dict(capacity)} "
        "(each phase fits alone, not both at once)"
    )


class _Program:
    """Eq. (5) as a SCIP model, re-solved with a no-good cut after each answer for the top-k.

    The objective is `objective_key` encoded exactly as one integer. Taus are replaced by
    their ranks among the distinct taus of all options (equal taus, equal rank), which keeps
    every comparison Eq. (5) makes, so the argmin is the same; Z becomes the rank of the
    bottleneck tau. With K distinct taus and B = 1 + most GPUs any pair can use, the value

        B * (K * rank(bottleneck) + rank(other phase)) + GPUs
            = B * (K - 1) * Z + B * (rank_pre + rank_dec) + GPUs      (as Z = max of the two)

    orders pairs exactly as the key does, and is linear. A float objective with small
    weights for the tie-breaks (Z + eps * (tau_pre + tau_dec) + ...) is not: its GPU term
    falls below SCIP's tolerances at a few hundred GPUs, and SCIP then returned the pairs
    in another order than the brute force on inputs with equal taus (which the simulator
    produces, e.g. once a phase has more replicas than its load needs). An integer objective
    lets SCIP prune by whole units, which nothing rounds away.
    """

    def __init__(self, by_phase: Mapping[Phase, Sequence[PoolOption]], capacity: Mapping[str, int]):
        self.model = model = Model("ampd-eq5")
        model.hideOutput()
        self.cuts = 0
        self.options = [o for phase in PHASES for o in by_phase[phase]]
        distinct = sorted({o.tau for o in self.options})
        rank = {tau: r for r, tau in enumerate(distinct)}
        top_rank = len(distinct) - 1
        gpu_base = 1 + sum(max(o.gpus for o in by_phase[phase]) for phase in PHASES)
        # u[i] = 1: the phase is provisioned exactly as option i.
        self.u = [model.addVar(f"u_{i}", vtype="B") for i in range(len(self.options))]
        z = model.addVar("Z", vtype="I", lb=0, ub=top_rank)
        pools = self._pool_vars(by_phase)
        self._link_pools(pools)
        for phase in PHASES:
            members = [i for i, o in enumerate(self.options) if o.phase == phase]
            # Exactly one option per phase: tau was simulated for a homogeneous pool (module docstring).
            model.addCons(quicksum(self.u[i] for i in members) == 1, name=f"one_{phase}")
            # (C1)/(C2) as the paper writes them: Z >= tau(o) for every used o; big-M turns the
            # "where used" into a linear row, M = the largest rank keeps it slack when u = 0.
            for i in members:
                model.addCons(z >= rank[self.options[i].tau] - top_rank * (1 - self.u[i]), name=f"c_{phase}_{i}")
            # The same bound summed over the phase: with exactly one u = 1 it is the chosen rank,
            # so it cuts off no integer point, but it dominates the big-M rows in the LP relaxation
            # (where Z could otherwise sit near 0 with fractional u), so SCIP's bound is tight.
            model.addCons(z >= quicksum(rank[self.options[i].tau] * self.u[i] for i in members), name=f"agg_{phase}")
        self._capacity(pools, capacity)
        ranks = quicksum(rank[o.tau] * self.u[i] for i, o in enumerate(self.options))
        gpus = quicksum(n * var for (_, (_, n)), var in pools.items())
        model.setObjective(gpu_base * top_rank * z + gpu_base * ranks + gpus, "minimize")
        model.setObjIntegral()

    def _pool_vars(self, by_phase: Mapping[Phase, Sequence[PoolOption]]) -> dict:
        """x[t, n] (prefill) and y[t, n] (decode): replicas of degree n on type t, integers >= 0."""
        pools = {}
        for phase in PHASES:
            letter = "x" if phase == "prefill" else "y"
            for gpu, n in sorted({o.pool for o in by_phase[phase]}):
                pools[(phase, (gpu, n))] = self.model.addVar(f"{letter}_{gpu}_{n}", vtype="I", lb=0)
        return pools

    def _link_pools(self, pools: dict) -> None:
        """x[t, n] = sum of replicas * u over the phase's options on (t, n); likewise y."""
        for (phase, pool), var in pools.items():
            members = [i for i, o in enumerate(self.options) if o.phase == phase and o.pool == pool]
            replicas = quicksum(self.options[i].replicas * self.u[i] for i in members)
            self.model.addCons(var == replicas, name=f"link_{phase}_{pool[0]}_{pool[1]}")

    def _capacity(self, pools: dict, capacity: Mapping[str, int]) -> None:
        """(C3) per GPU type t: sum_n n x[t, n] + sum_n n y[t, n] <= capacity[t] (0 if absent)."""
        for gpu in sorted({pool[0] for _, pool in pools}):
            used = quicksum(n * var for (_, (t, n)), var in pools.items() if t == gpu)
            self.model.addCons(used <= capacity.get(gpu, 0), name=f"capacity_{gpu}")

    def solve_next(self, time_limit_s: float) -> tuple[tuple[PoolOption, PoolOption] | None, str]:
        """The best pair not yet excluded, then a no-good cut excluding it; None when none is left."""
        model = self.model
        model.setParam("limits/time", max(time_limit_s, 0.01))
        model.optimize()
        status = model.getStatus()
        if model.getNSols() == 0:
            return None, status
        solution = model.getBestSol()
        # Options are listed prefill first, and exactly one u per phase is 1.
        p, d = (i for i, var in enumerate(self.u) if model.getSolVal(solution, var) > 0.5)
        # pyscipopt refuses new constraints on a solved (transformed) model: back to the original
        # problem, then forbid exactly this pair; either option may still recur with another partner.
        model.freeTransform()
        self.cuts += 1
        model.addCons(self.u[p] + self.u[d] <= 1, name=f"nogood_{self.cuts}")
        return (self.options[p], self.options[d]), status
