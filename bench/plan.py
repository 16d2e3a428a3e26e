"""`ampd bench plan`: the whole planning path's time as the cluster grows.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), Appendix A.2:
the paper plans 256 GPUs in about a minute. Here, for N in {8, 64, 256} H20 running
Llama-3.1-70B, a ToolBench trace sized to the cluster (600 sessions at 1.25/s, 1,000 at
10/s, 2,000 at 40/s: loads each cluster serves near its knee, the traces
`ampd trace generate` makes with seed 0) goes through ``planner.plan.plan`` as `ampd plan`
runs it - its defaults, every core: the tau search (simulations, planner.tau_search),
Eq. 5 in SCIP, the whole-system re-ranking of its candidates and, where they miss
rounds, the split search. Reports the wall time from the profile book to the answer,
the simulations it took, the first choice and its simulated attainment, and the time
as a ratio of the paper's minute. The target: 256 GPUs in under 10 s.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

CLUSTERS = {8: (600, 1.25), 64: (1000, 10.0), 256: (2000, 40.0)}  # GPUs -> (sessions, sessions/s)
GPU, MODEL = "H20", "llama-3.1-70b"
PAPER_S = 60.0  # "about a minute" for 256 GPUs (Appendix A.2)
TARGET_S = 10.0


@dataclass(frozen=True)
class Row:
    gpus: int
    sessions: int
    rate: float
    wall_s: float
    simulated: int  # tau coefficients simulated; the rest were bounded
    coefficients: int
    solve_s: float  # of it, SCIP's
    first: str
    attainment: float  # the first choice's, simulated whole


def plan_once(gpus: int, jobs: int) -> Row:
    from ampd.planning import deployment_label, slo_for
    from perfmodel.slo import DEFAULT_SCALE
    from planner.plan import Judging, ProfileBook, plan
    from planner.trace import WORKLOADS, generate

    sessions, rate = CLUSTERS[gpus]
    trace = generate(WORKLOADS["toolbench"], sessions, rate, seed=0)
    started = time.perf_counter()
    book = ProfileBook(MODEL, [])
    result = plan(Judging(book, slo_for(book, GPU, DEFAULT_SCALE, None, None)), trace, {GPU: gpus}, jobs=jobs)
    wall = time.perf_counter() - started
    best = result.ranked[0]
    return Row(gpus, sessions, rate, wall, len(result.samples), len(result.options), result.solve_s,
               deployment_label(best.deployment), best.predicted.slo_attainment_rounds)  # fmt: skip


def run_plan_bench(console: Console, sizes: list[int], out: Path | None) -> int:
    unknown = [n for n in sizes if n not in CLUSTERS]
    if unknown:
        console.print(f"[red]no trace for {unknown} GPUs: sizes are {', '.join(map(str, CLUSTERS))}[/red]")
        return 2
    jobs = os.cpu_count() or 1
    rows = []
    for gpus in sizes:
        with console.status(f"planning {gpus} GPUs"):
            rows.append(plan_once(gpus, jobs))
    table = Table("GPUs", "trace", "plan time", "x the paper's minute", "simulated / coefficients", "SCIP",
                  "first choice", "its attainment")  # fmt: skip
    for r in rows:
        table.add_row(str(r.gpus), f"{r.sessions:,} at {r.rate:g}/s", f"{r.wall_s:.1f} s",
                      f"{r.wall_s / PAPER_S:.2f}x", f"{r.simulated} / {r.coefficients}", f"{r.solve_s:.2f} s",
                      r.first, f"{r.attainment:.1%}")  # fmt: skip
    console.print(table)
    console.print(f"{MODEL} on H20, ToolBench, {jobs} cores; target: 256 GPUs in under {TARGET_S:g} s")
    if out is not None:
        body = {"model": MODEL, "gpu": GPU, "cores": jobs, "machine": platform.machine(), "paper_s": PAPER_S,
                "target_s": TARGET_S, "rows": [asdict(r) for r in rows]}  # fmt: skip
        out.write_text(json.dumps(body, indent=2) + "\n")
        console.print(f"wrote {out}")
    return 0
