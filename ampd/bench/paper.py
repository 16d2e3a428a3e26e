"""`ampd bench paper`: the AMPD paper's end-to-end comparison, in the simulator.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), section 7: each trace runs
on the paper's cluster size (8 GPUs for ToolBench and HotpotQA, 16 for DuReader, 32 for GAIA; section 7.1), and
each policy on its own best deployment at each arrival rate (section 7.1, "Protocols"):

* ``ampd`` on the deployment the offline planner picks (planner.plan: Eq. 5 solved with
  SCIP, its top candidates simulated whole);
* ``disagg`` (Dynamo) on the best of every prefill/decode split that uses the whole
  cluster, one TP degree per phase, found by simulating each ("tune the model
  deployment for all baselines and report the best results");
* ``coloc`` (vLLM) and ``continuum`` on the best colocated TP x DP that fills the cluster;
* the ablations (Figure 5) on ampd's planned deployment, so that only the technique differs.

Reported: SLO attainment per trace, rate and policy (Figure 4, top), mean TTFT of initial
and incremental rounds and mean ITL (Figure 4, bottom), the local/remote mix of ampd's
incremental prefills (Figure 5, right), ampd's average and maximum relative improvement
over each baseline (section 7.2 reports 67.29% over Dynamo and 339.74% over vLLM on
average), and the sensitivity to w, alpha and beta (Figure 6: DuReader, 16 GPUs).

SLOs are per trace, DistServe's way: a scale times the unloaded latency of the trace's
typical round (its mean prompt tokens) at the smallest TP degree that fits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.progress import Progress

from ampd.bench.sweep import SweepPoint
from perfmodel.catalog import TP_DEGREES
from perfmodel.slo import SLO
from planner.plan import ProfileBook, attainment_key, plan
from planner.simulator import Pool, SimConfig, SimReport, simulate
from planner.trace import WORKLOADS, generate

PAPER_GPUS = {"toolbench": 8, "hotpotqa": 8, "dureader": 16, "gaia": 32}  # section 7.1
# Section 7.2: ampd's average SLO-attainment improvement over Dynamo and over vLLM.
PAPER_AVERAGE_IMPROVEMENT = {"disagg": 0.6729, "coloc": 3.3974}
PAPER_LOCAL_SHARE = (0.139, 0.317)  # section 7.2, ablation study
# Sessions per second, around each trace's knee for Llama-3.1-70B on H20 in our model
# (the paper's rates are in its figures only; its breakdown runs at 2 sessions/s).
DEFAULT_RATES = {
    "toolbench": (1.5, 2.0, 2.5, 3.0),
    "hotpotqa": (0.8, 1.0, 1.2, 1.5),
    "dureader": (0.8, 1.0, 1.2, 1.5),
    "gaia": (0.5, 1.0, 1.5),
}
# Sessions per point: enough for the load to build up. A GAIA session lasts minutes
# (11 rounds of ~530 output tokens), so fewer than several minutes of arrivals never
# reach the steady state.
DEFAULT_SESSIONS = {"toolbench": 300, "hotpotqa": 300, "dureader": 300, "gaia": 800}
POLICIES = ("ampd", "disagg", "coloc", "continuum", "ampd-routing-only", "ampd-reorder-only")
BASELINES = ("disagg", "coloc", "continuum")
SENSITIVITY = {"window": (2, 3, 4, 5), "alpha": (0.7, 0.8, 0.9, 1.0), "beta": (0.7, 0.8, 0.85, 0.9, 1.0)}


def degrees_dividing(book: ProfileBook, gpu: str, gpus: int) -> list[int]:
    return [n for n in book.feasible(gpu) if gpus % n == 0]


def disaggregated_candidates(book: ProfileBook, gpu: str, gpus: int) -> list[tuple[Pool, Pool]]:
    """Every (prefill, decode) pair that uses all ``gpus``: one TP degree per phase."""
    out = []
    smallest = min(TP_DEGREES)
    for prefill_gpus in range(smallest, gpus, smallest):
        for p in degrees_dividing(book, gpu, prefill_gpus):
            for d in degrees_dividing(book, gpu, gpus - prefill_gpus):
                decode_gpus = gpus - prefill_gpus
                out.append((Pool(book.get(gpu, p), prefill_gpus // p), Pool(book.get(gpu, d), decode_gpus // d)))
    return out


def colocated_candidates(book: ProfileBook, gpu: str, gpus: int) -> list[Pool]:
    return [Pool(book.get(gpu, n), gpus // n) for n in degrees_dividing(book, gpu, gpus)]


def best(reports: Sequence[SimReport]) -> SimReport:
    return min(reports, key=attainment_key)


@dataclass(frozen=True)
class Improvement:
    """ampd's relative SLO-attainment improvement over one baseline, over every point where
    the baseline met any round ((ampd - base) / base; the paper's measure)."""

    baseline: str
    average: float | None
    maximum: float | None
    points: int
    baseline_zero: int  # points left out: the baseline met no round there


def improvement(points: Sequence[SweepPoint], baseline: str) -> Improvement:
    ampd = {(p.workload, p.rate): p.slo_attainment_rounds for p in points if p.policy == "ampd"}
    base = {(p.workload, p.rate): p.slo_attainment_rounds for p in points if p.policy == baseline}
    shared = [k for k in ampd if k in base]
    gains = [(ampd[k] - base[k]) / base[k] for k in shared if base[k] > 0]
    average = sum(gains) / len(gains) if gains else None
    return Improvement(baseline, average, max(gains) if gains else None, len(gains), len(shared) - len(gains))


def run_trace(
    book: ProfileBook,
    gpu: str,
    workload: str,
    rates: Sequence[float],
    sessions: int,
    slo: SLO,
    seed: int,
    progress: Progress | None = None,
) -> list[SweepPoint]:
    """Every policy on its best deployment at each rate (module docstring). The searches'
    simulations run on every core while the planner runs here."""
    gpus = PAPER_GPUS[workload]
    split = disaggregated_candidates(book, gpu, gpus)
    together = colocated_candidates(book, gpu, gpus)
    steps = len(split) + 2 * len(together) + 3  # simulations per rate, the plan counted as one
    task = progress.add_task(f"{workload} ({gpus} GPUs)", total=len(rates) * steps) if progress else None

    def tick(_: object = None) -> None:
        if progress is not None and task is not None:
            progress.advance(task)

    points = []
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        for rate in rates:
            trace = generate(WORKLOADS[workload], sessions, rate, seed)

            def run(policy: str, prefill: Pool | None, decode: Pool, trace=trace) -> Future[SimReport]:
                config = SimConfig(decode=decode, prefill=prefill, slo=slo, policy=policy, seed=seed)
                future = pool.submit(simulate, config, trace)
                future.add_done_callback(tick)
                return future

            searched = {
                "disagg": [run("disagg", p, d) for p, d in split],
                "coloc": [run("coloc", None, together_pool) for together_pool in together],
                "continuum": [run("continuum", None, together_pool) for together_pool in together],
            }
            planned = plan(book, trace, {gpu: gpus}, slo, policy="ampd", top=1).ranked[0]
            tick()
            prefill = Pool(book.get(gpu, planned.deployment.prefill.tp), planned.deployment.prefill.replicas)
            decode = Pool(book.get(gpu, planned.deployment.decode.tp), planned.deployment.decode.replicas)
            ablations = {a: run(a, prefill, decode) for a in ("ampd-routing-only", "ampd-reorder-only")}
            chosen = {"ampd": planned.predicted}
            chosen |= {policy: best([f.result() for f in futures]) for policy, futures in searched.items()}
            chosen |= {policy: future.result() for policy, future in ablations.items()}
            points += [SweepPoint.of(workload, rate, chosen[policy]) for policy in POLICIES]
    return points


@dataclass(frozen=True)
class SensitivityPoint:
    parameter: str  # window (w), alpha or beta
    value: float
    slo_attainment_rounds: float
    local_share_incremental: float


def sensitivity(
    book: ProfileBook, gpu: str, workload: str, rate: float, sessions: int, slo: SLO, seed: int
) -> tuple[str, list[SensitivityPoint]]:
    """Figure 6: ampd on its planned deployment, one hyper-parameter varied at a time from
    the paper's defaults (alpha 0.9, beta 0.85, w 3). Returns the deployment and the points."""
    trace = generate(WORKLOADS[workload], sessions, rate, seed)
    d = plan(book, trace, {gpu: PAPER_GPUS[workload]}, slo, policy="ampd", top=1).ranked[0].deployment
    base = SimConfig(
        decode=Pool(book.get(gpu, d.decode.tp), d.decode.replicas),
        prefill=Pool(book.get(gpu, d.prefill.tp), d.prefill.replicas),
        slo=slo,
        seed=seed,
    )
    varied = [(parameter, value) for parameter, values in SENSITIVITY.items() for value in values]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        futures = [pool.submit(simulate, replace(base, **{parameter: value}), trace) for parameter, value in varied]
        reports = [f.result() for f in futures]
    points = [
        SensitivityPoint(parameter, value, report.slo_attainment_rounds, report.local_share_incremental)
        for (parameter, value), report in zip(varied, reports, strict=True)
    ]
    return f"P TP{d.prefill.tp}x{d.prefill.replicas} + D TP{d.decode.tp}x{d.decode.replicas}", points


# -- reports ------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def markdown(
    points: Sequence[SweepPoint],
    improvements: Sequence[Improvement],
    slos: dict[str, SLO],
    sensitivity_points: Sequence[SensitivityPoint],
    sensitivity_setup: str,
) -> str:
    lines = []
    for workload in dict.fromkeys(p.workload for p in points):
        mine = [p for p in points if p.workload == workload]
        slo = slos[workload]
        lines += [
            f"### {workload}, {PAPER_GPUS[workload]} GPUs (SLO TTFT {slo.ttft_s:.2f} s, ITL {slo.itl_s * 1e3:.0f} ms)",
            "",
            "| rate (sessions/s) | " + " | ".join(POLICIES) + " | ampd local share |",
            "|" + " --- |" * (len(POLICIES) + 2),
        ]
        at = {(p.rate, p.policy): p for p in mine}
        for rate in sorted({p.rate for p in mine}):
            cells = [f"{at[(rate, policy)].slo_attainment_rounds:.1%}" for policy in POLICIES]
            cells.append(f"{at[(rate, 'ampd')].local_share_incremental:.0%}")
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
        lines += ["", "Deployments (per rate): " + "; ".join(
            f"{rate:g}/s " + ", ".join(f"`{policy}` {at[(rate, policy)].deployment}" for policy in POLICIES[:4])
            for rate in sorted({p.rate for p in mine})
        ), ""]  # fmt: skip
    lines += [
        "### ampd's relative improvement in SLO attainment",
        "",
        "| over | average | maximum | points | left out (baseline at 0%) | paper's average |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for imp in improvements:
        paper = PAPER_AVERAGE_IMPROVEMENT.get(imp.baseline)
        lines.append(f"| {imp.baseline} | {_pct(imp.average)} | {_pct(imp.maximum)} | {imp.points} | "
                     f"{imp.baseline_zero} | {_pct(paper)} |")  # fmt: skip
    shares = [p.local_share_incremental for p in points if p.policy == "ampd"]
    low, high = PAPER_LOCAL_SHARE
    lines += ["", f"ampd's local share of incremental prefills: {min(shares):.1%} to {max(shares):.1%} "
              f"(paper: {low:.1%} to {high:.1%}).", ""]  # fmt: skip
    if sensitivity_points:
        lines += [f"### Sensitivity ({sensitivity_setup})", "", "| parameter | value | SLO attainment | local share |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {s.parameter} | {s.value:g} | {s.slo_attainment_rounds:.1%} | {s.local_share_incremental:.0%} |"
                  for s in sensitivity_points]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot_attainment(points: Sequence[SweepPoint], path: Path) -> None:
    """Figure 4's top row: SLO attainment against rate, a panel per trace."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(p.workload for p in points))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for policy in POLICIES:
            mine = sorted((p for p in points if p.workload == workload and p.policy == policy), key=lambda p: p.rate)
            ax.plot([p.rate for p in mine], [p.slo_attainment_rounds * 100 for p in mine], marker="o", label=policy)
        ax.set_title(f"{workload} ({PAPER_GPUS[workload]} GPUs)")
        ax.set_xlabel("sessions/s")
        ax.set_ylabel("SLO attainment (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    _save(fig, path)


def plot_breakdown(points: Sequence[SweepPoint], path: Path) -> None:
    """Figure 4's bottom row at each trace's middle rate: mean TTFT (initial, incremental), mean ITL."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(p.workload for p in points))
    metrics = [
        ("mean TTFT, initial (s)", "ttft_mean_initial_s", 1.0),
        ("mean TTFT, incremental (s)", "ttft_mean_incremental_s", 1.0),
        ("mean ITL (ms)", "itl_mean_s", 1e3),
    ]
    fig, axes = plt.subplots(len(metrics), len(workloads), figsize=(4.5 * len(workloads), 8), squeeze=False)
    for col, workload in enumerate(workloads):
        rates = sorted({p.rate for p in points if p.workload == workload})
        rate = rates[len(rates) // 2]
        at = {p.policy: p for p in points if p.workload == workload and p.rate == rate}
        for row, (name, field, unit) in enumerate(metrics):
            ax = axes[row][col]
            values = [(getattr(at[policy], field) or 0.0) * unit for policy in POLICIES]
            ax.bar(range(len(POLICIES)), values, color=[f"C{i}" for i in range(len(POLICIES))])
            ax.set_xticks(range(len(POLICIES)), POLICIES, rotation=35, ha="right", fontsize=7)
            ax.set_title(f"{workload} at {rate:g}/s: {name}", fontsize=9)
    _save(fig, path)


def plot_mix(points: Sequence[SweepPoint], path: Path) -> None:
    """Figure 5, right: where ampd ran each trace's incremental prefills, per rate."""
    plt = _pyplot()
    mine = [p for p in points if p.policy == "ampd"]
    labels = [f"{p.workload}\n{p.rate:g}/s" for p in mine]
    local = [p.local_share_incremental * 100 for p in mine]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(mine)), 4))
    ax.bar(labels, local, label="local (decode worker)")
    ax.bar(labels, [100 - x for x in local], bottom=local, label="remote (prefill worker)")
    ax.set_ylabel("% of incremental prefills")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    _save(fig, path)


def plot_sensitivity(points: Sequence[SensitivityPoint], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(SENSITIVITY), figsize=(12, 3.6))
    for ax, parameter in zip(axes, SENSITIVITY, strict=True):
        mine = [p for p in points if p.parameter == parameter]
        ax.plot([p.value for p in mine], [p.slo_attainment_rounds * 100 for p in mine], marker="o")
        ax.set_xlabel(parameter)
        ax.set_ylabel("SLO attainment (%)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def write(
    out_dir: Path,
    title: str,
    points: Sequence[SweepPoint],
    slos: dict[str, SLO],
    sensitivity_setup: str,
    sensitivity_points: Sequence[SensitivityPoint],
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    improvements = [improvement(points, b) for b in BASELINES]
    data = {
        "title": title,
        "slos": {w: asdict(s) for w, s in slos.items()},
        "points": [asdict(p) for p in points],
        "improvements": [asdict(i) for i in improvements],
        "paper": {"average_improvement": PAPER_AVERAGE_IMPROVEMENT, "local_share": PAPER_LOCAL_SHARE},
        "sensitivity": {"setup": sensitivity_setup, "points": [asdict(s) for s in sensitivity_points]},
    }
    paths = [out_dir / name for name in ("paper.json", "paper.md", "attainment.png", "breakdown.png", "mix.png")]
    paths[0].write_text(json.dumps(data, indent=2) + "\n")
    paths[1].write_text(f"{title}\n\n" + markdown(points, improvements, slos, sensitivity_points, sensitivity_setup))
    plot_attainment(points, paths[2])
    plot_breakdown(points, paths[3])
    plot_mix(points, paths[4])
    if sensitivity_points:
        paths.append(out_dir / "sensitivity.png")
        plot_sensitivity(sensitivity_points, paths[-1], f"ampd sensitivity: {sensitivity_setup}")
    return paths


def trace_slo(book: ProfileBook, gpu: str, workload: str, scale: float) -> SLO:
    return book.reference_slo(gpu, scale, round(WORKLOADS[workload].mean_added_tokens))
