"""`ampd bench peers` over several trace seeds: each router's SLO attainment (mean and range),
on how many seeds it met the SLO in at least as many rounds as every other arm, its mean
TTFT, and its mean prefill tokens against ``ampd-memory``'s. One seed's live run moves an
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

from bench.peers import BASELINE


def table(runs: list[dict]) -> str:
    """Markdown: a row per router and ITL rule, over ``runs`` (peers JSON documents)."""
    rows = [dict(row, seed=run["setup"]["seed"]) for run in runs for row in run["rows"]]
    lines = [
        f"# `ampd bench peers`, seeds {', '.join(str(r['setup']['seed']) for r in runs)}\n",
        "| router | ITL rule | SLO attainment, mean (range) | best on seeds | TTFT p50 / p95 (ms), mean "
        f"| prefill tokens, mean | vs {BASELINE} |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for rule in dict.fromkeys(r["itl_rule"] for r in rows):
        ruled = [r for r in rows if r["itl_rule"] == rule]
        best = {s: max(r["attainment"] for r in ruled if r["seed"] == s) for s in {r["seed"] for r in ruled}}
        base = fmean(r["prefill_tokens"] for r in ruled if r["router"] == BASELINE)
        for router in dict.fromkeys(r["router"] for r in ruled):
            mine = [r for r in ruled if r["router"] == router]
            met = [100 * r["attainment"] for r in mine]
            tokens = fmean(r["prefill_tokens"] for r in mine)
            lines.append(
                f"| {router} | {rule} | {fmean(met):.1f}% ({min(met):.1f}-{max(met):.1f}) "
                f"| {sum(r['attainment'] >= best[r['seed']] for r in mine)} of {len(mine)} "
                f"| {fmean(r['ttft_p50_ms'] for r in mine):,.0f} / {fmean(r['ttft_p95_ms'] for r in mine):,.0f} "
                f"| {tokens:,.0f} | {tokens / base:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    print(table([json.loads(Path(p).read_text()) for p in sys.argv[1:]]), end="")


if __name__ == "__main__":
    main()
