"""The most a chunked KV hand-over (transfer overlapping compute) could buy: the same
simulations with the simulator's KV transfer time set to zero, decisions unchanged.

A one-off experiment, not part of the package: it patches ``planner.simulator.engine_side.t_kv``.
Each policy runs on every candidate deployment; a line gives the best attainment over
them, with the transfer as modelled -> free, judged by the mean and the P95 ITL rule.

    .venv/bin/python bench/studies/split/kv_overlap_bound.py toolbench      # every split of 8 GPUs
    .venv/bin/python bench/studies/split/kv_overlap_bound.py gaia dureader  # TP4 splits only (time)

Output of the runs behind the split study's table: bench/results/split/kv_overlap_bound.txt.
"""

import sys
from concurrent.futures import ProcessPoolExecutor

import planner.simulator.engine_side as sim
from bench.paper import PAPER_GPUS, colocated_candidates, disaggregated_candidates, trace_slo
from planner.plan import ProfileBook
from planner.simulator import SimConfig, simulate
from planner.trace import WORKLOADS, generate

POINTS = {"toolbench": ((2.0, 3.0), 300), "gaia": ((1.0,), 400), "dureader": ((1.2,), 300)}
ALL_SPLITS = {"toolbench"}  # the larger clusters: TP4 splits only, or the run takes hours


def run(job):
    free, config, trace, judges = job
    if free:
        sim.t_kv = lambda tokens, src, dst: 0.0
    report = simulate(config, trace)
    return [report.attainment(slo, rule) for slo, rule in judges]


def main(workloads: list[str]) -> None:
    book = ProfileBook("llama-3.1-70b")
    for workload in workloads:
        gpus = PAPER_GPUS[workload]
        splits, together = disaggregated_candidates(book, "H20", gpus), colocated_candidates(book, "H20", gpus)
        if workload not in ALL_SPLITS:
            splits = [(p, d) for p, d in splits if p.profile.tp == d.profile.tp == 4]
            together = [d for d in together if d.profile.tp == 4]
        rates, sessions = POINTS[workload]
        for rate in rates:
            trace = generate(WORKLOADS[workload], sessions, rate, 0)
            for scale in (3.0, 5.0):
                slo = trace_slo(book, "H20", workload, scale)
                judges = [(slo, "mean"), (slo, "p95")]
                jobs = [(policy, SimConfig(decode=d, prefill=p, slo=slo, policy=policy))
                        for policy in ("ampd", "disagg") for p, d in splits]  # fmt: skip
                jobs += [(f"dynaserve-{rule}", SimConfig(decode=d, prefill=None, slo=slo, policy="dynaserve",
                                                          itl_rule=rule))
                         for d in together for rule in ("mean", "p95")]  # fmt: skip
                best: dict[tuple[str, bool], list[float]] = {}
                for free in (False, True):
                    with ProcessPoolExecutor(2) as pool:
                        results = pool.map(run, [(free, config, trace, judges) for _, config in jobs])
                        for (policy, _), attained in zip(jobs, results, strict=True):
                            old = best.get((policy, free), [0.0, 0.0])
                            best[(policy, free)] = [max(a, b) for a, b in zip(old, attained, strict=True)]
                for policy in dict.fromkeys(policy for policy, _ in jobs):
                    (m0, p0), (m1, p1) = best[(policy, False)], best[(policy, True)]
                    print(
                        f"{workload} {rate} x{scale:g} {policy} mean: {m0:.3f}->{m1:.3f} p95: {p0:.3f}->{p1:.3f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main(sys.argv[1:])
