"""`ampd bench elastic`: load that moves, a fixed split against roles that follow it.

For each time-varying trace (planner.trace.Shape: a ramp, a burst, a day-shaped curve,
a mix that shifts from one workload to another) and each ITL rule, simulated on one
cluster:

* every policy with a fixed deployment on its best one for the whole trace (the split
  policies over every prefill/decode split that fills the cluster, the colocated ones
  over every TP x DP);
* ``elastic`` on each pool of one TP degree, with its role plan (planner.role_plan,
  made on another draw of the same shape), starting from the plan's split for the
  trace's first load; its ablations ``elastic-arrow`` (Arrow's SLO-driven moves alone)
  and ``elastic-dopd`` (DOPD's forecast and Eq. 14 alone) on the same pool and start,
  and ``elastic-split`` (rounds split between engines, DynaServe's Alg. 1);
* ``dynaserve`` (unified engines, split requests, steps sized to the ITL rule) on its
  best pool of one TP degree, fixed for the whole trace;
* the switching bound: for each pool, the best of its static splits for each minute's
  arriving sessions, taken separately - what moving roles could at most win on this
  trace if moves were free and instant (no run reaches it; it says how much there is
  to win).

The goal set for elastic roles: elastic reaches 1.3x the best fixed deployment's SLO attainment,
or closes half of its shortfall to 100%, whichever asks less. Every elastic run is
checked to finish every round of the trace (none lost or run twice by a move). Plots:
the load and each rule's elastic roles over time, per trace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from bench.figures import pyplot, save
from bench.paper import COLOCATED, SPLIT, colocated_candidates, disaggregated_candidates
from perfmodel.slo import SLO, ItlRule
from planner.plan import Judging
from planner.role_plan import PoolPlan, elastic_config, load_levels, opening_load, pools, split_config, split_ladder
from planner.simulator import SimConfig, SimReport, simulate
from planner.trace import WORKLOADS, Shape, TraceSession, generate_shaped

ELASTIC = ("elastic", "elastic-arrow", "elastic-dopd", "elastic-split")
# Policies whose decisions read neither the SLO nor the ITL rule: simulated once, judged by each rule.
BLIND = ("disagg", "dynamo-conditional", "uncached-threshold", *COLOCATED)


@dataclass(frozen=True)
class ShapedTrace:
    name: str
    workload: str
    shape: Shape
    to_workload: str | None = None

    def sessions(self, seed: int) -> list[TraceSession]:
        to = WORKLOADS[self.to_workload] if self.to_workload else None
        return generate_shaped(WORKLOADS[self.workload], self.shape, seed, to)


DEFAULT_TRACES = (
    ShapedTrace("toolbench ramp", "toolbench", Shape("ramp", 900.0, 0.5, 3.0)),
    ShapedTrace("toolbench burst", "toolbench", Shape("burst", 900.0, 0.8, 3.0)),
    ShapedTrace("hotpotqa diurnal", "hotpotqa", Shape("diurnal", 1200.0, 0.2, 1.0)),
    ShapedTrace("toolbench to hotpotqa", "toolbench", Shape("mix", 1200.0, 0.5, 1.5), "hotpotqa"),
)


@dataclass(frozen=True)
class Outcome:
    """One policy's best run on one trace under one rule."""

    trace: str
    rule: ItlRule
    policy: str
    slo_attainment_rounds: float
    deployment: str
    moves: int = 0
    rounds: int = 0


@dataclass(frozen=True)
class Verdict:
    trace: str
    rule: ItlRule
    best_fixed: Outcome
    elastic: Outcome
    required: float  # the goal: min(1.3 x best fixed, best fixed + half its shortfall)
    best_split: float  # the best static split of elastic's pools (ampd-tail on it, never moved)
    switching_bound: float  # the best pool's bound (module docstring)
    complete: bool  # every elastic run finished every round of the trace

    @property
    def met(self) -> bool:
        return self.elastic.slo_attainment_rounds >= self.required


def required(best: float) -> float:
    return min(1.3 * best, best + 0.5 * (1.0 - best))


def _deployment(report: SimReport) -> str:
    if report.roles:
        return f"pool {report.decode}, {report.roles[0].prefill} prefill at first"
    return f"D {report.decode}" if report.prefill == "none" else f"P {report.prefill} + D {report.decode}"


def _judged(config: SimConfig, trace: Sequence[TraceSession], judges: Sequence[tuple[SLO, ItlRule]]):
    """In the worker process: the report, and each judge's rounds met by minute of arrival."""
    report = simulate(config, trace)
    return report, [report.by_minute(slo, rule) for slo, rule in judges]


def _rate(minutes: dict[int, tuple[int, int]]) -> float:
    n = sum(n for _, n in minutes.values())
    return sum(m for m, _ in minutes.values()) / n if n else 0.0


def run_shaped(
    judging: Judging, gpu: str, gpus: int, trace: ShapedTrace, rules: Sequence[ItlRule], seed: int
) -> tuple[list[Outcome], list[Verdict], dict]:
    """Every policy on ``trace`` under each rule (``judging``'s book and SLO, its rule and
    policy set per run); the verdicts; and the timelines to plot."""
    sessions, planning = trace.sessions(seed), trace.sessions(seed + 1)
    total = sum(len(s.rounds) for s in sessions)
    book = judging.book
    splits, together = disaggregated_candidates(book, gpu, gpus), colocated_candidates(book, gpu, gpus)
    judges = [(judging.slo, rule) for rule in rules]
    outcomes: list[Outcome] = []
    verdicts: list[Verdict] = []
    timelines: dict = {"rate": _arrival_rate(sessions), "roles": {}}
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:

        def submit(config: SimConfig) -> Future:
            return pool.submit(_judged, config, sessions, judges)

        def run_plans(configs: Sequence[SimConfig], traces: Sequence[Sequence[TraceSession]]) -> list[SimReport]:
            return list(pool.map(simulate, configs, traces))

        def judged(policy: str, rule: ItlRule = "mean") -> Judging:
            return replace(judging, itl_rule=rule, policy=policy)

        def fixed(policy: str, rule: ItlRule) -> list[SimConfig]:
            if policy in COLOCATED:
                return [judged(policy).config(d, None, seed=seed) for d in together]
            return [judged(policy, rule).config(d, p, seed=seed) for p, d in splits]

        runs: dict[tuple[str, ItlRule | None], list[Future]] = {}
        for policy in BLIND + ("ampd",):
            runs[(policy, None)] = [submit(c) for c in fixed(policy, "mean")]
        for rule in rules:
            runs[("ampd-tail", rule)] = [submit(c) for c in fixed("ampd-tail", rule)]
            runs[("dynaserve", rule)] = [submit(judged("dynaserve", rule).config(d, None, seed=seed)) for d in together]
        plans: dict[ItlRule, list[PoolPlan]] = {
            rule: pools(judged("elastic", rule), planning, gpu, gpus, load_levels(planning), run_plans, seed + 1)
            for rule in rules
        }
        for rule in rules:
            for policy in ELASTIC:
                runs[(policy, rule)] = [
                    submit(elastic_config(judged(policy, rule), gpu, p, opening_load(sessions), seed))
                    for p in plans[rule]
                ]
            # Each pool's static splits, for the switching bound.
            runs[("static", rule)] = [
                submit(split_config(judged("elastic", rule), gpu, p.tp, p.engines, k, seed))
                for p in plans[rule]
                for k in split_ladder(p.engines)
            ]
        done = {key: [f.result() for f in futures] for key, futures in runs.items()}

    for index, rule in enumerate(rules):

        def best(key: tuple[str, ItlRule | None], index: int = index, rule: ItlRule = rule) -> Outcome:
            report, minutes = max(done[key], key=lambda run: _rate(run[1][index]))
            return Outcome(trace.name, rule, key[0], _rate(minutes[index]), _deployment(report), report.moves,
                           report.rounds)  # fmt: skip

        mine = [best((p, None)) for p in BLIND + ("ampd",)]
        mine += [best(("ampd-tail", rule)), best(("dynaserve", rule))]
        mine += [best((p, rule)) for p in ELASTIC]
        outcomes += mine
        fixed_best = max((o for o in mine if o.policy not in ELASTIC), key=lambda o: o.slo_attainment_rounds)
        elastic = next(o for o in mine if o.policy == "elastic")
        bound = _switching_bound(done[("static", rule)], plans[rule], index)
        split = max(_rate(minutes[index]) for _, minutes in done[("static", rule)])
        complete = all(report.rounds == total for key in runs if key[0] in ELASTIC for report, _ in done[key])
        verdicts.append(Verdict(trace.name, rule, fixed_best, elastic, required(fixed_best.slo_attainment_rounds),
                                split, bound, complete))  # fmt: skip
        chosen, _ = max(done[("elastic", rule)], key=lambda run: _rate(run[1][index]))
        timelines["roles"][rule] = [(r.at, r.prefill) for r in chosen.roles]
        timelines.setdefault("engines", {})[rule] = len(chosen.workers)
    return outcomes, verdicts, timelines


def _switching_bound(static: list, plans: list[PoolPlan], index: int) -> float:
    """The best pool's sum over arrival minutes of its best static split's rounds met."""
    bounds, at = [], 0
    for plan in plans:
        runs = static[at : at + len(split_ladder(plan.engines))]
        at += len(runs)
        minutes = set().union(*(r[1][index].keys() for r in runs))
        n = sum(runs[0][1][index].get(m, (0, 0))[1] for m in minutes)
        met = sum(max(r[1][index].get(m, (0, 0))[0] for r in runs) for m in minutes)
        bounds.append(met / n if n else 0.0)
    return max(bounds)


def _arrival_rate(sessions: Sequence[TraceSession], window_s: float = 30.0) -> list[tuple[float, float]]:
    arrivals = np.array([s.arrival_s for s in sessions])
    edges = np.arange(0.0, arrivals.max() + window_s, window_s)
    counts = np.histogram(arrivals, bins=edges)[0]
    return [(float(t), float(c) / window_s) for t, c in zip(edges[:-1], counts, strict=True)]


# -- reports ------------------------------------------------------------------------------
POLICY_ORDER = (*ELASTIC, "dynaserve", *SPLIT, *COLOCATED)


def markdown(title: str, outcomes: Sequence[Outcome], verdicts: Sequence[Verdict]) -> str:
    lines = [title, "", "## Goal: elastic against the best fixed deployment of any policy", "",
             "| trace | ITL rule | best fixed (policy, deployment) | elastic (pool, moves) | goal | met | "
             "pools' best fixed split | switching bound | rounds all finished |", "|" + " --- |" * 9]  # fmt: skip
    for v in verdicts:
        lines.append(
            f"| {v.trace} | {v.rule} | {v.best_fixed.slo_attainment_rounds:.1%} ({v.best_fixed.policy}, "
            f"{v.best_fixed.deployment}) | {v.elastic.slo_attainment_rounds:.1%} ({v.elastic.deployment}, "
            f"{v.elastic.moves} moves) | {v.required:.1%} | {'yes' if v.met else 'no'} | {v.best_split:.1%} | "
            f"{v.switching_bound:.1%} | "
            f"{'yes' if v.complete else 'NO'} |"
        )
    lines += [
        "",
        "## Every policy on its best deployment",
        "",
        "| trace | ITL rule | " + " | ".join(POLICY_ORDER) + " |",
        "|" + " --- |" * (2 + len(POLICY_ORDER)),
    ]
    at = {(o.trace, o.rule, o.policy): o for o in outcomes}
    for trace, rule in dict.fromkeys((o.trace, o.rule) for o in outcomes):
        row = [f"{at[(trace, rule, p)].slo_attainment_rounds:.1%}" for p in POLICY_ORDER]
        lines.append(f"| {trace} | {rule} | " + " | ".join(row) + " |")
    lines += ["", "Deployments:", ""]
    lines += [f"- {o.trace}, {o.rule}, `{o.policy}`: {o.deployment}" + (f", {o.moves} moves" if o.moves else "")
              for o in outcomes]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot_roles(trace: str, timelines: dict, path: Path) -> None:
    """The arrival rate over time, and the prefill engines of elastic's best pool under each rule."""
    plt = pyplot()
    fig, (load, roles) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    t, rate = zip(*timelines["rate"], strict=True)
    load.plot(t, rate, color="C7")
    load.set_ylabel("sessions/s (30 s windows)")
    load.set_title(f"{trace}: the load, and the engines elastic gives the prefill role")
    for i, (rule, steps) in enumerate(timelines["roles"].items()):
        if steps:
            at, prefill = zip(*steps, strict=True)
            ends = [*at[1:], t[-1]]
            xs = [x for a, b in zip(at, ends, strict=True) for x in (a, b)]
            ys = [y for y in prefill for _ in (0, 1)]
            roles.plot(xs, [y + 0.04 * i for y in ys], label=f"{rule} ITL ({timelines['engines'][rule]} engines)")
    most = max(timelines["engines"].values())
    roles.set_ylim(-0.3, most - 0.7)  # a pool keeps one engine decoding
    roles.yaxis.get_major_locator().set_params(integer=True)
    roles.set_xlabel("seconds")
    roles.set_ylabel("prefill engines")
    roles.legend(fontsize=8)
    roles.grid(alpha=0.3)
    save(fig, path)


def write(out_dir: Path, title: str, outcomes, verdicts, timelines: dict[str, dict], wall_s: float) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "title": title,
        "wall_s": wall_s,
        "verdicts": [dict(asdict(v), met=v.met) for v in verdicts],
        "outcomes": [asdict(o) for o in outcomes],
        "timelines": timelines,
    }
    paths = [out_dir / "elastic.json", out_dir / "elastic.md"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n")
    paths[1].write_text(markdown(title, outcomes, verdicts))
    for trace, timeline in timelines.items():
        paths.append(out_dir / f"roles_{trace.replace(' ', '_')}.png")
        plot_roles(trace, timeline, paths[-1])
    return paths
