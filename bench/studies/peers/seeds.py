"""`ampd bench peers` over several trace seeds: each router's SLO attainment (mean and range)
and the simulator's for the same arm, on how many seeds it met the SLO in at least as many
rounds as every other arm, its mean TTFT and P95 token gap, and its mean prefill tokens
against the deployment's baseline arm's (``ampd-memory``, ``ampd-disagg``). One seed's live run moves an
arm by several points under the P95 rule, as much as the arms differ, so a verdict is
read over seeds.

    .venv/bin/python -m bench.studies.peers.seeds bench/results/peers/peers.json \\
        bench/results/peers/peers_seed1.json bench/results/peers/peers_seed2.json \\
        > bench/results/peers/seeds.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import fmean

from bench.peers import BASELINES


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return fmean(known) if len(known) == len(values) and known else None


def _simulated(run: dict, row: dict) -> float | None:
    """The simulator's attainment for the row's arm and rule: in the row, or in the run's
    ``simulated`` section (where rows did not carry it yet)."""
    if row.get("simulated_attainment") is not None:
        return row["simulated_attainment"]
    return run.get("simulated", {}).get(row["router"], {}).get("attainment", {}).get(row["itl_rule"])


def table(runs: list[dict]) -> str:
    """Markdown: a row per router and ITL rule, over ``runs`` (peers JSON documents of one
    deployment); the simulator's attainment beside the live one where it has one."""
    deployment = runs[0]["setup"].get("deployment", "coloc")
    baseline = BASELINES[deployment]
    rows = [dict(row, seed=run["setup"]["seed"], simulated_attainment=_simulated(run, row))
            for run in runs for row in run["rows"]]  # fmt: skip
    lines = [
        f"# `ampd bench peers --deployment {deployment}`, seeds {', '.join(str(r['setup']['seed']) for r in runs)}\n",
        "| router | ITL rule | SLO attainment, mean (range) | simulated, mean | best on seeds | TTFT p50 / p95 (ms), "
        f"mean | P95 gap (ms), mean | prefill tokens, mean | vs {baseline} |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for rule in dict.fromkeys(r["itl_rule"] for r in rows):
        ruled = [r for r in rows if r["itl_rule"] == rule]
        best = {s: max(r["attainment"] for r in ruled if r["seed"] == s) for s in {r["seed"] for r in ruled}}
        base = _mean([r["prefill_tokens"] for r in ruled if r["router"] == baseline] or [None])
        for router in dict.fromkeys(r["router"] for r in ruled):
            mine = [r for r in ruled if r["router"] == router]
            met = [100 * r["attainment"] for r in mine]
            simulated = _mean([r.get("simulated_attainment") for r in mine])
            gaps = [r["gap_p95_ms"] for r in mine if r.get("gap_p95_ms") is not None]
            gap = f"{fmean(gaps):.0f}" + ("" if len(gaps) == len(mine) else f" ({len(gaps)} seeds)") if gaps else "-"
            tokens = fmean(r["prefill_tokens"] for r in mine)
            lines.append(
                f"| {router} | {rule} | {fmean(met):.1f}% ({min(met):.1f}-{max(met):.1f}) "
                f"| {'-' if simulated is None else f'{100 * simulated:.1f}%'} "
                f"| {sum(r['attainment'] >= best[r['seed']] for r in mine)} of {len(mine)} "
                f"| {fmean(r['ttft_p50_ms'] for r in mine):,.0f} / {fmean(r['ttft_p95_ms'] for r in mine):,.0f} "
                f"| {gap} | {tokens:,.0f} "
                f"| {'-' if base is None else f'{tokens / base:.2f}x'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    print(table([json.loads(Path(p).read_text()) for p in sys.argv[1:]]), end="")


if __name__ == "__main__":
    main()
