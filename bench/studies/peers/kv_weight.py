"""``--placement ampd``'s weight on KV use (rounds.placement.KV_WEIGHT), simulated on both
placement benches' traces over several seeds, beside llm-d's rule:

* `ampd bench peers`' trace and engines (policy ``coloc``, 3 engines of 170k KV tokens:
  a session a tenth of an engine's KV), seeds 0-4;
* `ampd bench placement`'s (policy ``ampd``, 4 prefill + 4 decode engines of H20 TP4,
  1,000 sessions of 16 agent types x 8 tenants at 0.3/s), seeds 0-2.

    .venv/bin/python -m bench.studies.peers.kv_weight > bench/results/peers/kv_weight.txt
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from statistics import fmean

import rounds.placement as placement
from bench import placement as placement_bench
from bench.peers import PeersSetup, simulated
from perfmodel.profile import load_profile
from planner.trace import Agents

WEIGHTS = (0.0, 0.25, 0.5, 1.0)
PEERS_SEEDS = (0, 1, 2, 3, 4)
PLACEMENT_SEEDS = (0, 1, 2)
PLACEMENT_RATE = 0.3  # the placement bench's knee on these traces


def peers(seed: int, rule: str) -> tuple[float, float, int]:
    """Attainment under the mean and P95 rules, and prefill tokens, on the peers bench's trace."""
    setup = replace(PeersSetup(), seed=seed)
    trace = setup.trace()
    arm = simulated(setup, trace, setup.slo(trace), [f"ampd-{rule}"])[f"ampd-{rule}"]
    return arm["attainment"]["mean"], arm["attainment"]["p95"], arm["prefill_tokens"]


def placement_trace(seed: int, rule: str) -> tuple[float, float, int]:
    """The same on the placement bench's trace."""
    setup = placement_bench.Setup(load_profile("llama-3.1-70b_h20_tp4"), 4, 4, "toolbench", Agents(16, 8), 1000,
                                  seed, "ampd", 5.0)  # fmt: skip
    mean, p95 = (placement_bench.run_one(setup, PLACEMENT_RATE, rule, r) for r in ("mean", "p95"))  # type: ignore[arg-type]
    return mean.attainment, p95.attainment, mean.prefill_tokens


def one(job: tuple[str, int, str, float]) -> tuple[float, float, int]:
    trace, seed, rule, weight = job
    placement.KV_WEIGHT = weight
    return (peers if trace == "peers" else placement_trace)(seed, rule)


def main() -> None:
    arms = [("llmd-prefix", placement.KV_WEIGHT)] + [("ampd", w) for w in WEIGHTS]
    for trace, seeds in (("peers", PEERS_SEEDS), ("placement", PLACEMENT_SEEDS)):
        jobs = [(trace, seed, rule, weight) for rule, weight in arms for seed in seeds]
        with ProcessPoolExecutor() as pool:
            results = dict(zip(jobs, pool.map(one, jobs), strict=True))
        print(f"{trace} bench's trace, seeds {', '.join(map(str, seeds))}: mean over seeds (per seed)")
        for rule, weight in arms:
            mine = [results[(trace, seed, rule, weight)] for seed in seeds]
            name = rule if rule != "ampd" else f"ampd, KV_WEIGHT {weight:g}"
            per_seed = " ".join(f"{m:.1%}/{p:.1%}/{t / 1000:,.0f}k" for m, p, t in mine)
            print(f"  {name}: mean {fmean(m for m, _, _ in mine):.1%}, p95 {fmean(p for _, p, _ in mine):.1%}, "
                  f"prefill tokens {fmean(t for _, _, t in mine):,.0f} ({per_seed})")  # fmt: skip


if __name__ == "__main__":
    main()
