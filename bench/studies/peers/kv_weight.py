"""``--placement ampd``'s weight on KV use (rounds.placement.KV_WEIGHT) on `ampd bench peers`'
trace and engines, simulated: with their small KV (a session a tenth of an engine's) and with
a real H20 TP4 engine's order of KV (46,875 blocks of 16: 750k tokens), beside ``memory`` and
llm-d's rule.

    .venv/bin/python -m bench.studies.peers.kv_weight > bench/results/peers/kv_weight.txt
"""

from __future__ import annotations

from dataclasses import replace

import rounds.placement as placement
from bench.peers import PeersSetup
from perfmodel.profile import load_profile
from planner.simulator import Pool, SimConfig, Simulation
from rounds.engine.scheduler import SchedulerConfig


def run(setup: PeersSetup, rule: str) -> str:
    trace = setup.trace()
    scheduler = SchedulerConfig(block_size=setup.block_size, num_blocks=setup.num_blocks)
    config = SimConfig(Pool(load_profile(setup.profile), setup.engines), None, setup.slo(trace), policy=setup.policy,
                       placement=rule, scheduler=scheduler, seed=setup.seed)  # type: ignore[arg-type]  # fmt: skip
    sim = Simulation(config, trace)
    sim.run()
    met = sim.report().slo_attainment_by_rule
    computed = sum(w.prefill_tokens for w in sim.workers.values())
    return f"mean {met['mean']:.1%}, p95 {met['p95']:.1%}, prefill tokens {computed:,}"


def main() -> None:
    shipped = placement.KV_WEIGHT
    for blocks in (PeersSetup().num_blocks, 46_875):
        setup = replace(PeersSetup(), num_blocks=blocks)
        print(f"{blocks:,} blocks ({blocks * setup.block_size:,} KV tokens) per engine")
        for rule in ("memory", "llmd-prefix"):
            print(f"  {rule}: {run(setup, rule)}")
        for weight in (0.25, shipped, 1.0, 2.0):
            placement.KV_WEIGHT = weight
            print(f"  ampd, KV_WEIGHT {weight:g}: {run(setup, 'ampd')}")
        placement.KV_WEIGHT = shipped


if __name__ == "__main__":
    main()
