"""`ampd bench simulate`: the simulator's speed on a long trace, on one core.

A ToolBench-shaped trace (seed 1) through 8 H20 running Llama-3.1-70B, prefill and
decode one TP4 replica each, under AMPD's policy; reports sessions, rounds, virtual
seconds and the wall time the simulation took.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from perfmodel.profile import load_profile
from perfmodel.slo import derived_slo
from planner.simulator import Pool, SimConfig, simulate
from planner.trace import WORKLOADS, generate


def run_simulate_bench(console: Console, sessions: int, rate: float, out: Path | None) -> int:
    trace = generate(WORKLOADS["toolbench"], sessions, rate, seed=1)
    tp4 = load_profile("llama-3.1-70b_h20_tp4")
    config = SimConfig(
        decode=Pool(tp4, 1), prefill=Pool(tp4, 1), slo=derived_slo(load_profile("llama-3.1-70b_h20_tp2"))
    )
    with console.status(f"simulating {sessions:,} sessions"):
        report = simulate(config, trace)
    console.print(
        f"{report.sessions:,} sessions, {report.rounds:,} rounds, {report.makespan_s:,.0f} s simulated in "
        f"{report.wall_s:.1f} s wall ({report.rounds / report.wall_s:,.0f} rounds/s); "
        f"SLO attainment {report.slo_attainment_rounds:.1%}"
    )
    if out is not None:
        out.write_text(json.dumps({"sessions": sessions, "rate": rate, "report": report.model_dump()}, indent=2) + "\n")
        console.print(f"wrote {out}")
    return 0
