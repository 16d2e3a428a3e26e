"""`ampd bench paper`: the AMPD paper's comparison, simulated, as a grid of SLO definitions.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), section 7,
runs each policy on its best deployment at the paper's cluster sizes (8 GPUs for
ToolBench and HotpotQA, 16 for DuReader, 32 for GAIA; section 7.1) and judges a round's
ITL by its mean. Which policy wins depends on how a round is judged, so this bench runs
that comparison over a grid: ITL rule {mean, p95} (perfmodel.slo) x SLO scale {3, 5}
(DistServe's thresholds: a scale times the unloaded latency of the trace's typical
round at the smallest TP degree that fits), all four traces at their rates, and every
policy on its best deployment in each cell:

* ``ampd``, ``ampd-tail``, ``disagg``, ``dynamo-conditional`` and ``uncached-threshold``
  over every prefill/decode split that fills the cluster (one TP degree per phase);
* ``coloc`` and ``continuum`` over every colocated TP x DP that fills it;
* ``dynaserve`` (unified engines, prompts split between two of them) over the same
  pools of TP x DP; ``elastic`` and ``elastic-split`` on each pool, from its role plan.

Best = the highest SLO attainment in the cell, then the lower P95 TTFT. A policy whose
decisions do not read the SLO (the baselines) is simulated once per point and judged in
every cell; ampd's decisions read the thresholds (Alg. 1's slack), so it is simulated
once per SLO scale; ampd-tail's also read the ITL rule, so it is simulated per scale
under each tail rule, and under the mean rule it is ampd decision for decision. (The
earlier version of this bench put ampd on the planner's deployment; the search gives
every policy the same chance, and the planner is judged on its own in ``ampd plan
--validate``.)

Per cell: the winner at each point; ampd's and ampd-tail's average and maximum
relative improvement over each baseline ((a - b) / b over the points where b > 0, the
paper's measure: section 7.2 reports +67.29% over Dynamo's disaggregation and
+339.74% over vLLM); and the breakdown behind them (TTFT, each round's gaps, the local
share of incremental prefills). The sensitivity study (Figure 6) runs ampd on the
planner's deployment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.progress import Progress

from bench.figures import pyplot, save
from bench.sweep import SweepPoint
from perfmodel.catalog import TP_DEGREES
from perfmodel.slo import SLO, ItlRule
from planner.plan import Judging, ProfileBook, plan
from planner.role_plan import PoolPlan, elastic_config, pools, split_ladder
from planner.simulator import Pool, SimConfig, SimReport, simulate
from planner.trace import WORKLOADS, TraceSession, generate, rounds_per_session

PAPER_GPUS = {"toolbench": 8, "hotpotqa": 8, "dureader": 16, "gaia": 32}  # section 7.1
SHORT = {"toolbench": "TB", "hotpotqa": "HQ", "dureader": "DR", "gaia": "GA"}
# Section 7.2: ampd's average SLO-attainment improvement over Dynamo and over vLLM.
PAPER_AVERAGE_IMPROVEMENT = {"disagg": 0.6729, "coloc": 3.3974}
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
DEFAULT_RULES: tuple[ItlRule, ...] = ("mean", "p95")
DEFAULT_SCALES = (3.0, 5.0)
SPLIT = ("ampd", "ampd-tail", "disagg", "dynamo-conditional", "uncached-threshold")
COLOCATED = ("coloc", "continuum")
POLICIES = ("elastic", "elastic-split", "dynaserve", *SPLIT, *COLOCATED)
OURS = ("elastic", "ampd", "ampd-tail", "dynaserve", "elastic-split")
PER_CELL = ("ampd-tail", "elastic", "elastic-split", "dynaserve")  # simulated in each cell: they read rule and SLO
BASELINES = ("coloc", "disagg", "dynamo-conditional", "uncached-threshold", "continuum")
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


def trace_slo(book: ProfileBook, gpu: str, workload: str, scale: float) -> SLO:
    return book.reference_slo(gpu, scale, round(WORKLOADS[workload].mean_added_tokens))


@dataclass(frozen=True)
class Cell:
    """One SLO definition of the grid."""

    rule: ItlRule
    scale: float

    @property
    def label(self) -> str:
        return f"{self.rule} ITL, SLO scale {self.scale:g}"

    @property
    def stem(self) -> str:
        return f"{self.rule}_x{self.scale:g}"

    def judging(self, book: ProfileBook, gpu: str, workload: str, policy: str = "ampd") -> Judging:
        """The cell as ``policy`` on ``workload``'s trace is judged in it (its SLO: trace_slo)."""
        return Judging(book, trace_slo(book, gpu, workload, self.scale), self.rule, policy)


@dataclass(frozen=True)
class GridPoint(SweepPoint):
    slo_scale: float = 5.0


def simulate_and_judge(config: SimConfig, trace: Sequence[TraceSession], judges: Sequence[tuple[SLO, ItlRule]]):
    """One simulation, judged by every (SLO, rule) asked for, in the worker process: only the
    summary and the attainments travel back."""
    report = simulate(config, trace)
    return report, [report.attainment(slo, rule) for slo, rule in judges]


def grid_plans(
    book: ProfileBook,
    gpu: str,
    workload: str,
    rates: Sequence[float],
    sessions: int,
    cells: Sequence[Cell],
    seed: int,
    submit: Callable[[SimConfig, Sequence[TraceSession]], Future],
) -> dict[tuple[Cell, int], PoolPlan]:
    """The elastic policy's plan for each pool (TP degree) in each cell: planner.role_plan
    on another draw of the trace (``seed + 1``) at the grid's rates."""
    planning = generate(WORKLOADS[workload], sessions, rates[0], seed + 1)

    def run(configs: Sequence[SimConfig], traces: Sequence[Sequence[TraceSession]]) -> list[SimReport]:
        return [f.result() for f in [submit(c, t) for c, t in zip(configs, traces, strict=True)]]

    plans = {}
    for cell in cells:
        for p in pools(cell.judging(book, gpu, workload), planning, gpu, PAPER_GPUS[workload], rates, run, seed + 1):
            plans[(cell, p.tp)] = p
    return plans


def run_trace(
    book: ProfileBook,
    gpu: str,
    workload: str,
    rates: Sequence[float],
    sessions: int,
    cells: Sequence[Cell],
    seed: int,
    progress: Progress | None = None,
) -> list[GridPoint]:
    """Every policy on its best deployment, per rate and cell (module docstring), on every core."""
    gpus = PAPER_GPUS[workload]
    splits, together = disaggregated_candidates(book, gpu, gpus), colocated_candidates(book, gpu, gpus)
    scales = sorted({c.scale for c in cells})
    slos = {scale: trace_slo(book, gpu, workload, scale) for scale in scales}
    tail_rules = sorted({c.rule for c in cells} - {"mean"})
    shapes = [gpus // n for n in degrees_dividing(book, gpu, gpus)]
    planning = len(cells) * len(rates) * sum(len(split_ladder(n)) for n in shapes)
    per_rate = (3 * len(splits) + len(COLOCATED) * len(together)) + len(scales) * len(splits) * (1 + len(tail_rules))
    per_rate += len(cells) * (2 * len(shapes) + len(together))
    total = planning + len(rates) * per_rate
    task = progress.add_task(f"{workload} ({gpus} GPUs)", total=total) if progress else None
    judges = [(slos[c.scale], c.rule) for c in cells]
    points: list[GridPoint] = []
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:

        def submit(config: SimConfig, trace: Sequence[TraceSession], judged: bool = False) -> Future:
            future = pool.submit(simulate_and_judge, config, trace, judges) if judged else pool.submit(
                simulate, config, trace
            )  # fmt: skip
            if progress is not None and task is not None:
                future.add_done_callback(lambda _: progress.advance(task))
            return future

        plans = grid_plans(book, gpu, workload, rates, sessions, cells, seed, submit)
        for rate in rates:
            trace = generate(WORKLOADS[workload], sessions, rate, seed)
            load = rate * rounds_per_session(trace)  # rounds per second, as the role plans count it

            def run(
                policy: str, prefill: Pool | None, decode: Pool, scale: float, rule: ItlRule = "mean", trace=trace
            ) -> Future:
                config = SimConfig(decode=decode, prefill=prefill, slo=slos[scale], policy=policy, seed=seed,
                                   itl_rule=rule)  # fmt: skip
                return submit(config, trace, judged=True)

            # (policy, the scale it decided by or None, the rule it decided by or None) -> runs
            runs: dict[tuple[str, float | None, str | None], list[Future]] = {}
            for policy in ("disagg", "dynamo-conditional", "uncached-threshold"):
                runs[(policy, None, None)] = [run(policy, p, d, scales[-1]) for p, d in splits]
            for policy in COLOCATED:
                runs[(policy, None, None)] = [run(policy, None, d, scales[-1]) for d in together]
            for scale in scales:
                runs[("ampd", scale, None)] = [run("ampd", p, d, scale) for p, d in splits]
                for rule in tail_rules:
                    runs[("ampd-tail", scale, rule)] = [run("ampd-tail", p, d, scale, rule) for p, d in splits]
            for cell in cells:  # each pool, starting from its plan's split for the rate
                for policy in ("elastic", "elastic-split"):
                    runs[(policy, cell.scale, cell.rule)] = [
                        submit(elastic_config(cell.judging(book, gpu, workload, policy), gpu, plan, load, seed),
                               trace, judged=True)
                        for (planned, _), plan in plans.items() if planned == cell
                    ]  # fmt: skip
                runs[("dynaserve", cell.scale, cell.rule)] = [
                    run("dynaserve", None, d, cell.scale, cell.rule) for d in together
                ]
            done = {key: [f.result() for f in futures] for key, futures in runs.items()}
            for index, cell in enumerate(cells):
                for policy in POLICIES:
                    if policy == "ampd-tail" and cell.rule == "mean":  # ampd, decision for decision
                        key = ("ampd", cell.scale, None)
                    elif policy in PER_CELL:
                        key = (policy, cell.scale, cell.rule)
                    else:
                        key = (policy, cell.scale if policy == "ampd" else None, None)
                    report, attainments = max(done[key], key=lambda run: (run[1][index], -(run[0].ttft.p95_s or 0)))
                    point = SweepPoint.of(workload, rate, report, slos[cell.scale], cell.rule)
                    points.append(GridPoint(**asdict(replace(point, policy=policy)), slo_scale=cell.scale))
    return points


@dataclass(frozen=True)
class Improvement:
    """One of ours against one baseline, over every point where the baseline met any round
    ((ours - base) / base; the paper's measure)."""

    policy: str
    baseline: str
    average: float | None
    maximum: float | None
    points: int
    baseline_zero: int  # points left out: the baseline met no round there


def improvement(points: Sequence[SweepPoint], baseline: str, policy: str = "ampd") -> Improvement:
    ours = {(p.workload, p.rate): p.slo_attainment_rounds for p in points if p.policy == policy}
    base = {(p.workload, p.rate): p.slo_attainment_rounds for p in points if p.policy == baseline}
    shared = [k for k in ours if k in base]
    gains = [(ours[k] - base[k]) / base[k] for k in shared if base[k] > 0]
    average = sum(gains) / len(gains) if gains else None
    return Improvement(policy, baseline, average, max(gains) if gains else None, len(gains), len(shared) - len(gains))


def winners(points: Sequence[SweepPoint]) -> dict[tuple[str, float], list[str]]:
    """Per (trace, rate): the policies with the highest attainment (several on a tie)."""
    best: dict[tuple[str, float], list[str]] = {}
    for key in dict.fromkeys((p.workload, p.rate) for p in points):
        here = [p for p in points if (p.workload, p.rate) == key]
        top = max(p.slo_attainment_rounds for p in here)
        best[key] = [p.policy for p in here if p.slo_attainment_rounds >= top - 1e-12]
    return best


@dataclass(frozen=True)
class Shortfall:
    """At one point: elastic's attainment less the best other policy's (on its best deployment)."""

    workload: str
    rate: float
    gap: float
    best: str  # the best other policy


def elastic_shortfalls(points: Sequence[SweepPoint]) -> list[Shortfall]:
    out = []
    for key in dict.fromkeys((p.workload, p.rate) for p in points):
        here = [p for p in points if (p.workload, p.rate) == key]
        ours = next(p.slo_attainment_rounds for p in here if p.policy == "elastic")
        best = max((p for p in here if p.policy != "elastic"), key=lambda p: p.slo_attainment_rounds)
        out.append(Shortfall(*key, ours - best.slo_attainment_rounds, best.policy))
    return out


CHUNKS = (0, 64, 256)  # decode workers' long_prefill_token_threshold in the ablation
CHUNKED = ("ampd", "ampd-tail", "coloc")
KNEES = {"toolbench": 2.5, "hotpotqa": 1.2, "dureader": 1.5}  # where the grid's policies part


@dataclass(frozen=True)
class ChunkPoint:
    workload: str
    rate: float
    itl_rule: ItlRule
    slo_scale: float
    policy: str
    chunk: int  # 0: a prefill runs in one step
    slo_attainment_rounds: float
    deployment: str


def chunk_ablation(
    book: ProfileBook, gpu: str, workload: str, rate: float, sessions: int, cells: Sequence[Cell], seed: int
) -> list[ChunkPoint]:
    """Chunked prefill on the decode workers (vLLM's long_prefill_token_threshold), the
    Sarathi-Serve remedy for stalls: ampd, ampd-tail and coloc, each on its best
    deployment, at each chunk size and cell."""
    gpus = PAPER_GPUS[workload]
    splits, together = disaggregated_candidates(book, gpu, gpus), colocated_candidates(book, gpu, gpus)
    slos = {c.scale: trace_slo(book, gpu, workload, c.scale) for c in cells}
    judges = [(slos[c.scale], c.rule) for c in cells]
    trace = generate(WORKLOADS[workload], sessions, rate, seed)
    runs: dict[tuple[str, int, Cell], list[Future]] = {}
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        for chunk in CHUNKS:
            for cell in cells:
                for policy in CHUNKED:
                    pools = [(None, d) for d in together] if policy == "coloc" else splits
                    judging = cell.judging(book, gpu, workload, policy)
                    runs[(policy, chunk, cell)] = [
                        pool.submit(simulate_and_judge, judging.config(d, p, seed=seed, decode_prefill_chunk=chunk),
                                    trace, judges)
                        for p, d in pools
                    ]  # fmt: skip
        out = []
        for (policy, chunk, cell), futures in runs.items():
            index = cells.index(cell)
            report, attainments = max((f.result() for f in futures), key=lambda run: run[1][index])
            deployment = SweepPoint.of(workload, rate, report).deployment
            out.append(ChunkPoint(workload, rate, cell.rule, cell.scale, policy, chunk, attainments[index], deployment))
    return out


@dataclass(frozen=True)
class SensitivityPoint:
    parameter: str  # window (w), alpha or beta
    value: float
    slo_attainment_rounds: float
    local_share_incremental: float


def sensitivity(
    judging: Judging, gpu: str, workload: str, rate: float, sessions: int, seed: int
) -> tuple[str, list[SensitivityPoint]]:
    """Figure 6: ``judging``'s policy (ampd, in the paper) on its planned deployment, one
    hyper-parameter varied at a time from the paper's defaults (alpha 0.9, beta 0.85, w 3).
    Returns the deployment and the points."""
    trace = generate(WORKLOADS[workload], sessions, rate, seed)
    d = plan(judging, trace, {gpu: PAPER_GPUS[workload]}, top=1).ranked[0].deployment
    decode = judging.pool(gpu, d.decode.tp, d.decode.replicas)
    prefill = judging.pool(gpu, d.prefill.tp, d.prefill.replicas)
    base = judging.config(decode, prefill, seed=seed)
    varied = [(parameter, value) for parameter, values in SENSITIVITY.items() for value in values]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        futures = [pool.submit(simulate, replace(base, **{parameter: value}), trace) for parameter, value in varied]
        reports: list[SimReport] = [f.result() for f in futures]
    points = [
        SensitivityPoint(parameter, value, report.slo_attainment_rounds, report.local_share_incremental)
        for (parameter, value), report in zip(varied, reports, strict=True)
    ]
    return f"P TP{d.prefill.tp}x{d.prefill.replicas} + D TP{d.decode.tp}x{d.decode.replicas}", points


# -- reports ------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f}"


def cell_points(points: Sequence[GridPoint], cell: Cell) -> list[GridPoint]:
    return [p for p in points if p.itl_rule == cell.rule and p.slo_scale == cell.scale]


def summary_table(points: Sequence[GridPoint], cells: Sequence[Cell]) -> list[str]:
    """Per cell: the winner at each point, and ours' average improvement over each baseline."""
    shown = [b for b in BASELINES if b != "continuum"]
    lines = [
        "| cell | winner at each point | " + " | ".join(f"{o} vs {b}" for o in OURS for b in shown)
        + " | elastic within 1 point of the best other | elastic's worst shortfall |",
        "|" + " --- |" * (4 + len(OURS) * len(shown)),
    ]  # fmt: skip
    for cell in cells:
        mine = cell_points(points, cell)
        won = "; ".join(f"{SHORT[w]} {r:g}: {'/'.join(ps) if len(ps) < len(POLICIES) else 'all tie'}"
                        for (w, r), ps in winners(mine).items())  # fmt: skip
        gains = [_pct(improvement(mine, b, o).average) for o in OURS for b in shown]
        short = elastic_shortfalls(mine)
        worst = min(short, key=lambda x: x.gap)
        within = f"{sum(x.gap >= -0.01 for x in short)} of {len(short)}"
        lines.append(f"| {cell.label} | {won} | " + " | ".join(gains)
                     + f" | {within} | {worst.gap * 100:+.1f} points ({SHORT[worst.workload]} {worst.rate:g}, "
                     f"{worst.best}) |")  # fmt: skip
    return lines


def markdown(
    points: Sequence[GridPoint],
    cells: Sequence[Cell],
    slos: dict[tuple[str, float], SLO],
    chunk_points: Sequence[ChunkPoint],
    sensitivity_points: Sequence[SensitivityPoint],
    sensitivity_setup: str,
) -> str:
    lines = ["## Summary", "", *summary_table(points, cells), ""]
    for cell in cells:
        mine = cell_points(points, cell)
        lines += [f"## {cell.label}", ""]
        for workload in dict.fromkeys(p.workload for p in mine):
            here = [p for p in mine if p.workload == workload]
            slo = slos[(workload, cell.scale)]
            lines += [f"### {workload}, {PAPER_GPUS[workload]} GPUs (SLO TTFT {slo.ttft_s:.2f} s, "
                      f"ITL {slo.itl_s * 1e3:.0f} ms by each round's {cell.rule} gap)", "",
                      "| rate (sessions/s) | " + " | ".join(POLICIES) + " | ampd local share |",
                      "|" + " --- |" * (len(POLICIES) + 2)]  # fmt: skip
            at = {(p.rate, p.policy): p for p in here}
            rates = sorted({p.rate for p in here})
            for rate in rates:
                cells_ = [f"{at[(rate, policy)].slo_attainment_rounds:.1%}" for policy in POLICIES]
                lines.append(
                    f"| {rate:g} | " + " | ".join(cells_) + f" | {at[(rate, 'ampd')].local_share_incremental:.0%} |"
                )
            lines += ["", "Breakdown (mean TTFT initial / incremental in s; each round's mean, P95 and longest "
                      "gap, averaged over rounds, in ms; deployment):", ""]  # fmt: skip
            for rate in rates:
                for policy in POLICIES:
                    p = at[(rate, policy)]
                    ttft = f"{p.ttft_mean_initial_s or 0:.2f} / {p.ttft_mean_incremental_s or 0:.2f}"
                    gaps = f"{_ms(p.itl_mean_s)} / {_ms(p.itl_p95_gap_mean_s)} / {_ms(p.itl_max_gap_mean_s)}"
                    lines.append(f"- {rate:g}/s `{policy}`: TTFT {ttft}; gaps {gaps}; {p.deployment}")
            lines.append("")
        lines += ["Elastic against the best other policy at each point (points of attainment): "
                  + "; ".join(f"{SHORT[x.workload]} {x.rate:g} {x.gap * 100:+.1f} ({x.best})"
                              for x in elastic_shortfalls(mine)), ""]  # fmt: skip
        lines += ["| relative improvement | " + " | ".join(BASELINES) + " |", "|" + " --- |" * (len(BASELINES) + 1)]
        for ours in OURS:
            imps = [improvement(mine, b, ours) for b in BASELINES]
            lines.append(f"| {ours}: average (maximum) | "
                         + " | ".join(f"{_pct(i.average)} ({_pct(i.maximum)})" for i in imps) + " |")  # fmt: skip
        lines.append("")
    if chunk_points:
        lines += ["## Chunked prefill on the decode workers (ablation at the knees)", "",
                  "| point | cell | " + " | ".join(f"{p} chunk {c or 'none'}" for p in CHUNKED for c in CHUNKS) + " |",
                  "|" + " --- |" * (2 + len(CHUNKED) * len(CHUNKS))]  # fmt: skip
        at = {(c.workload, c.itl_rule, c.slo_scale, c.policy, c.chunk): c for c in chunk_points}
        for workload, rate, rule, scale in dict.fromkeys((c.workload, c.rate, c.itl_rule, c.slo_scale)
                                                         for c in chunk_points):  # fmt: skip
            row = [f"{at[(workload, rule, scale, p, c)].slo_attainment_rounds:.1%}" for p in CHUNKED for c in CHUNKS]
            lines.append(f"| {workload} {rate:g}/s | {rule} ITL, scale {scale:g} | " + " | ".join(row) + " |")
        lines.append("")
    if sensitivity_points:
        lines += [f"## Sensitivity ({sensitivity_setup})", "", "| parameter | value | SLO attainment | local share |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {s.parameter} | {s.value:g} | {s.slo_attainment_rounds:.1%} | {s.local_share_incremental:.0%} |"
                  for s in sensitivity_points]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot_attainment(points: Sequence[GridPoint], path: Path, title: str) -> None:
    """Figure 4's top row for one cell: SLO attainment against rate, a panel per trace."""
    plt = pyplot()
    workloads = list(dict.fromkeys(p.workload for p in points))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for policy in POLICIES:
            mine = sorted((p for p in points if p.workload == workload and p.policy == policy), key=lambda p: p.rate)
            style = "-" if policy in OURS else "--"
            ax.plot([p.rate for p in mine], [p.slo_attainment_rounds * 100 for p in mine], style, marker="o",
                    label=policy)  # fmt: skip
        ax.set_title(f"{workload} ({PAPER_GPUS[workload]} GPUs)")
        ax.set_xlabel("sessions/s")
        ax.set_ylabel("SLO attainment (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    save(fig, path)


def plot_breakdown(points: Sequence[GridPoint], path: Path, title: str) -> None:
    """At each trace's middle rate: mean TTFT of incremental rounds, and each round's gaps."""
    plt = pyplot()
    workloads = list(dict.fromkeys(p.workload for p in points))
    metrics = [
        ("mean TTFT, incremental (s)", "ttft_mean_incremental_s", 1.0),
        ("each round's P95 gap, mean (ms)", "itl_p95_gap_mean_s", 1e3),
        ("each round's longest gap, mean (ms)", "itl_max_gap_mean_s", 1e3),
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
    fig.suptitle(title)
    save(fig, path)


def plot_sensitivity(points: Sequence[SensitivityPoint], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SENSITIVITY), figsize=(12, 3.6))
    for ax, parameter in zip(axes, SENSITIVITY, strict=True):
        mine = [p for p in points if p.parameter == parameter]
        ax.plot([p.value for p in mine], [p.slo_attainment_rounds * 100 for p in mine], marker="o")
        ax.set_xlabel(parameter)
        ax.set_ylabel("SLO attainment (%)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    save(fig, path)


def write(
    out_dir: Path,
    title: str,
    points: Sequence[GridPoint],
    cells: Sequence[Cell],
    slos: dict[tuple[str, float], SLO],
    chunk_points: Sequence[ChunkPoint],
    sensitivity_setup: str,
    sensitivity_points: Sequence[SensitivityPoint],
    wall_s: float,
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "title": title,
        "wall_s": wall_s,
        "cells": [
            {
                "rule": c.rule,
                "scale": c.scale,
                "points": [asdict(p) for p in cell_points(points, c)],
                "winners": [
                    {"workload": w, "rate": r, "policies": ps} for (w, r), ps in winners(cell_points(points, c)).items()
                ],
                "improvements": [asdict(improvement(cell_points(points, c), b, o)) for o in OURS for b in BASELINES],
                "elastic_shortfalls": [asdict(x) for x in elastic_shortfalls(cell_points(points, c))],
            }  # fmt: skip
            for c in cells
        ],
        "slos": [{"workload": w, "scale": s, **asdict(slo)} for (w, s), slo in slos.items()],
        "paper": {"average_improvement": PAPER_AVERAGE_IMPROVEMENT},
        "chunked_prefill": [asdict(c) for c in chunk_points],
        "sensitivity": {"setup": sensitivity_setup, "points": [asdict(s) for s in sensitivity_points]},
    }
    paths = [out_dir / "paper.json", out_dir / "paper.md"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n")
    paths[1].write_text(
        f"{title}\n\n" + markdown(points, cells, slos, chunk_points, sensitivity_points, sensitivity_setup)
    )
    for cell in cells:
        mine = cell_points(points, cell)
        paths += [out_dir / f"attainment_{cell.stem}.png", out_dir / f"breakdown_{cell.stem}.png"]
        plot_attainment(mine, paths[-2], f"{title}: {cell.label}")
        plot_breakdown(mine, paths[-1], f"{cell.label}")
    if sensitivity_points:
        paths.append(out_dir / "sensitivity.png")
        plot_sensitivity(sensitivity_points, paths[-1], f"ampd sensitivity: {sensitivity_setup}")
    return paths
