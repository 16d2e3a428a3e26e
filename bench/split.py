"""`ampd bench split`: DynaServe's two mechanisms taken apart, simulated.

"DynaServe: Unified and Elastic Execution for Dynamic Disaggregated LLM Serving" joins a
global scheduler that splits requests between two engines (section 4.1, Alg. 1) and a
local scheduler that sizes each batch to the TBT SLO (section 4.2, Alg. 2). In the paper
grid (`ampd bench paper`) ``dynaserve``'s best deployment can be one engine, where
nothing is split; this bench runs each pool of two or more engines at a trace's knee
and sets ``dynaserve`` beside ``dynaserve-alg1`` (Alg. 1's split point as printed),
``dynaserve-split-only``, ``dynaserve-batching-only`` and ``coloc`` on the same pool, in
each cell (ITL rule x SLO scale), with the share of rounds split - so the split's own
effect is measured where it can happen.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.paper import PAPER_GPUS, Cell, colocated_candidates
from planner.plan import ProfileBook
from planner.simulator import Pool, SimConfig, simulate
from planner.trace import WORKLOADS, TraceSession, generate

ARMS = ("dynaserve", "dynaserve-alg1", "dynaserve-split-only", "dynaserve-batching-only", "coloc")


@dataclass(frozen=True)
class SplitPoint:
    workload: str
    rate: float
    itl_rule: str
    slo_scale: float
    pool: str
    policy: str
    slo_attainment_rounds: float
    split_share: float  # rounds whose prompt was split between two engines
    ttft_p95_s: float | None


def _run(config: SimConfig, trace: Sequence[TraceSession]) -> tuple[float, float, float | None]:
    """Attainment, the share of split rounds and P95 TTFT of one simulation (in a worker process)."""
    report = simulate(config, trace)
    return report.slo_attainment_rounds, report.split_share, report.ttft.p95_s


def run_split(
    book: ProfileBook, gpu: str, workload: str, rate: float, sessions: int, cells: Sequence[Cell], seed: int
) -> list[SplitPoint]:
    trace = generate(WORKLOADS[workload], sessions, rate, seed)
    pools: list[Pool] = [d for d in colocated_candidates(book, gpu, PAPER_GPUS[workload]) if d.replicas > 1]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as executor:
        futures = {
            (cell, d.label(), policy): executor.submit(
                _run, cell.judging(book, gpu, workload, policy).config(d, None, seed=seed), trace)
            for cell in cells for d in pools for policy in ARMS
        }  # fmt: skip
        return [
            SplitPoint(workload, rate, cell.rule, cell.scale, pool, policy, *future.result())
            for (cell, pool, policy), future in futures.items()
        ]


def markdown(points: Sequence[SplitPoint], title: str) -> str:
    lines = [title, "", "| point | cell | pool | " + " | ".join(ARMS) + " | rounds split (dynaserve / Alg. 1) |",
             "|" + " --- |" * (4 + len(ARMS))]  # fmt: skip
    rows = dict.fromkeys((p.workload, p.rate, p.itl_rule, p.slo_scale, p.pool) for p in points)
    at = {(p.workload, p.rate, p.itl_rule, p.slo_scale, p.pool, p.policy): p for p in points}
    for workload, rate, rule, scale, pool in rows:
        cells = [f"{at[(workload, rate, rule, scale, pool, a)].slo_attainment_rounds:.1%}" for a in ARMS]
        split = [at[(workload, rate, rule, scale, pool, a)].split_share for a in ("dynaserve", "dynaserve-alg1")]
        point = f"| {workload} {rate:g}/s | {rule} x{scale:g} | {pool} | "
        lines.append(point + " | ".join(cells) + f" | {split[0]:.1%} / {split[1]:.0%} |")
    return "\n".join(lines) + "\n"


def write(out_dir: Path, points: Sequence[SplitPoint], title: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data, md = out_dir / "split.json", out_dir / "split.md"
    data.write_text(json.dumps({"title": title, "points": [asdict(p) for p in points]}, indent=2) + "\n")
    md.write_text(markdown(points, title))
    return [data, md]
