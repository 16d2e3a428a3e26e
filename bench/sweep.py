"""`ampd bench sweep`: SLO attainment against load, per policy, in the simulator.

The shape of the AMPD paper's Figure 4 (AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"),
section 7.2): for one workload, every policy runs the same trace at each arrival rate
(one seed, so the rates differ only in arrival spacing), on the deployment given for
it - a prefill and a decode pool for the disaggregated policies, one colocated pool for
`coloc` and `continuum`. Reported per point: round SLO attainment, P95 TTFT of initial
and incremental rounds, P95 ITL and the local share of incremental prefills (Figure 5,
right). Rounds are judged by the ITL rule given (perfmodel.slo: mean, P95 or longest gap).
Written as JSON, a Markdown table and a PNG.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.progress import Progress

from bench.figures import pyplot, save
from perfmodel.slo import SLO, ItlRule
from planner.plan import Judging
from planner.simulator import Pool, SimReport, simulate
from planner.trace import Workload, generate
from rounds.policies import POLICIES


@dataclass(frozen=True)
class SweepPoint:
    workload: str
    rate: float
    policy: str
    deployment: str
    gpus: int
    itl_rule: ItlRule  # how its rounds were judged
    slo_attainment_rounds: float
    ttft_p95_initial_s: float | None
    ttft_p95_incremental_s: float | None
    itl_p95_s: float | None  # P95 over rounds of each round's mean gap
    local_share_incremental: float
    ttft_mean_initial_s: float | None  # the means are the paper's Figure 4 breakdown (bottom row)
    ttft_mean_incremental_s: float | None
    itl_mean_s: float | None  # mean over rounds of each round's mean gap ...
    itl_p95_gap_mean_s: float | None  # ... of its P95 gap
    itl_max_gap_mean_s: float | None  # ... of its longest gap

    @classmethod
    def of(
        cls, workload: str, rate: float, report: SimReport, slo: SLO | None = None, rule: ItlRule | None = None
    ) -> SweepPoint:
        """The point as ``report`` judged it, or judged again by ``slo`` and ``rule``."""
        if report.roles:  # an elastic pool: its roles over time are in the report
            start = report.roles[0].prefill
            deployment = f"pool {report.decode}, {start} prefill at first, {report.moves} moves"
        elif report.prefill == "none":
            deployment = f"D {report.decode}"
        else:
            deployment = f"P {report.prefill} + D {report.decode}"
        rule = rule or report.itl_rule
        attainment = report.slo_attainment_by_rule[rule] if slo is None else report.attainment(slo, rule)
        return cls(
            workload, rate, report.policy, deployment, report.gpus, rule, attainment,
            report.ttft_initial.p95_s, report.ttft_incremental.p95_s, report.itl.p95_s,
            report.local_share_incremental, report.ttft_initial.mean_s, report.ttft_incremental.mean_s,
            report.itl.mean_s, report.itl_p95.mean_s, report.itl_max.mean_s,
        )  # fmt: skip


def sweep(
    workload: Workload,
    rates: list[float],
    policies: list[str],
    disaggregated: tuple[Pool, Pool],
    colocated: Pool,
    judging: Judging,
    sessions: int,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[SweepPoint]:
    """Every (rate, policy) point, judged by ``judging``'s SLO and ITL rule (each of
    ``policies`` in turn serving); ``disaggregated`` is (prefill, decode)."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    task = progress.add_task(f"{workload.name}", total=len(rates) * len(policies)) if progress else None
    points = []
    for rate in rates:
        trace = generate(workload, sessions, rate, seed)
        for policy in policies:
            prefill, decode = disaggregated if POLICIES[policy].uses_prefill_workers else (None, colocated)
            config = judging.config(decode, prefill, policy=policy, seed=seed)
            points.append(SweepPoint.of(workload.name, rate, simulate(config, trace)))
            if progress is not None and task is not None:
                progress.advance(task)
    return points


def markdown(points: list[SweepPoint]) -> str:
    """SLO attainment (rounds) per rate and policy, with P95 incremental TTFT and local share."""
    policies = list(dict.fromkeys(p.policy for p in points))
    rates = sorted({p.rate for p in points})
    at = {(p.rate, p.policy): p for p in points}
    head = "| rate (sessions/s) | " + " | ".join(policies) + " |"
    lines = [head, "|" + " --- |" * (len(policies) + 1)]
    for rate in rates:
        cells = []
        for policy in policies:
            p = at[(rate, policy)]
            ttft = "-" if p.ttft_p95_incremental_s is None else f"{p.ttft_p95_incremental_s:.2f} s"
            local = f"{p.local_share_incremental:.0%}"
            cells.append(f"{p.slo_attainment_rounds:.1%} (P95 incr. TTFT {ttft}, local {local})")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    deployments = {p.policy: f"{p.deployment} ({p.gpus} GPUs)" for p in points}
    lines += ["", "Deployments: " + "; ".join(f"`{k}` {v}" for k, v in deployments.items())]
    return "\n".join(lines) + "\n"


def plot(points: list[SweepPoint], path: Path, title: str) -> None:
    """Three panels against rate: SLO attainment, P95 incremental TTFT, local share."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("SLO attainment (rounds)", lambda p: p.slo_attainment_rounds * 100, "%"),
        ("P95 TTFT, incremental rounds", lambda p: p.ttft_p95_incremental_s, "s"),
        ("local share of incremental prefills", lambda p: p.local_share_incremental * 100, "%"),
    ]
    for ax, (name, value, unit) in zip(axes, panels, strict=True):
        for policy in dict.fromkeys(p.policy for p in points):
            mine = sorted((p for p in points if p.policy == policy), key=lambda p: p.rate)
            ax.plot([p.rate for p in mine], [value(p) for p in mine], marker="o", label=policy)
        ax.set_title(name)
        ax.set_xlabel("arrival rate (sessions/s)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    save(fig, path, dpi=110)


def write(points: list[SweepPoint], out_dir: Path, stem: str, title: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps({"title": title, "points": [asdict(p) for p in points]}, indent=2) + "\n")
    paths[1].write_text(f"{title}\n\n{markdown(points)}")
    plot(points, paths[2], title)
    return paths
