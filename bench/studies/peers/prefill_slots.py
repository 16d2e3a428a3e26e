"""How many prefills the colocated gateway lets each engine run at once (``--prefill-slots``),
simulated on `ampd bench peers`' trace and engines (policy ``coloc``, 3 engines of 170k KV
tokens) over seeds 0-4, for ``--placement ampd`` and llm-d's rule, on two workloads.

With one slot a session's short incremental prefill waits in the gateway's queue behind
another session's long first prompt on the same engine; with more, the engine schedules
them together, as vLLM's chunked prefill does for the requests a router sends it at once.

    .venv/bin/python -m bench.studies.peers.prefill_slots > bench/results/peers/prefill_slots.txt
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from statistics import fmean

from bench.peers import PeersSetup, simulated

SLOTS = (1, 2, 4, 8)
SEEDS = (0, 1, 2, 3, 4)
WORKLOADS = ("toolbench", "hotpotqa")
RULES = ("ampd", "llmd-prefix")


def one(job: tuple[str, int, str, int]) -> tuple[float, float, int]:
    workload, seed, rule, slots = job
    setup = replace(PeersSetup(), seed=seed, workload=workload, prefill_slots=slots)
    trace = setup.trace()
    arm = simulated(setup, trace, setup.slo(trace), [f"ampd-{rule}"])[f"ampd-{rule}"]
    return arm["attainment"]["mean"], arm["attainment"]["p95"], arm["prefill_tokens"]


def main() -> None:
    jobs = [(w, seed, rule, slots) for w in WORKLOADS for rule in RULES for slots in SLOTS for seed in SEEDS]
    with ProcessPoolExecutor() as pool:
        results = dict(zip(jobs, pool.map(one, jobs), strict=True))
    for workload in WORKLOADS:
        seeds = ", ".join(map(str, SEEDS))
        print(f"peers bench's engines, {workload} trace, seeds {seeds}: mean over seeds (per seed)")
        for rule in RULES:
            for slots in SLOTS:
                mine = [results[(workload, seed, rule, slots)] for seed in SEEDS]
                per_seed = " ".join(f"{m:.1%}/{p:.1%}/{t / 1000:,.0f}k" for m, p, t in mine)
                print(f"  {rule}, {slots} slot{'s' if slots > 1 else ''}: mean {fmean(m for m, _, _ in mine):.1%}, "
                      f"p95 {fmean(p for _, p, _ in mine):.1%}, prefill tokens {fmean(t for _, _, t in mine):,.0f} "
                      f"({per_seed})")  # fmt: skip


if __name__ == "__main__":
    main()
