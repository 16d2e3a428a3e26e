"""`ampd bench placement`: where sessions bind and remote prefills run, by each placement
rule (rounds.placement), on a trace whose sessions share their agents' prompts, simulated.

An agent population (planner.trace.with_agents: K agent types, T tenants, 5-25k tokens
of system prompt and tool schemas per type) runs through one disaggregated deployment
at its knee - the lowest rate tried at which ``memory`` (AMPD's binding as published)
misses the SLO in more than :data:`KNEE_MISS` of rounds - once per placement and ITL
rule. Each row gives the share of rounds that met the SLO and the prompt tokens the
engines computed (prefix-cache hits and pulled KV not counted): what the engines' own
caches saved under each rule.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from perfmodel.profile import Profile
from perfmodel.slo import SLO, ItlRule, derived_slo
from planner.simulator import Pool, SimConfig, Simulation
from planner.trace import WORKLOADS, Agents, TraceSession, generate, summarize, with_agents
from rounds.placement import PLACEMENTS, Placement

KNEE_MISS = 0.10  # the knee: the first rate at which memory misses the SLO in more rounds than this


@dataclass(frozen=True)
class Setup:
    """The deployment and trace every row ran."""

    profile: Profile
    prefill_replicas: int
    decode_replicas: int
    workload: str
    agents: Agents
    sessions: int
    seed: int
    policy: str
    slo_scale: float

    def trace(self, rate: float) -> list[TraceSession]:
        plain = generate(WORKLOADS[self.workload], self.sessions, rate, self.seed)
        return with_agents(plain, self.agents, self.seed)

    def slo(self, trace: Sequence[TraceSession]) -> SLO:
        """The SLO on the trace's typical round (its mean prompt tokens added per round),
        as the paper grid sets it per workload (bench.paper.trace_slo)."""
        return derived_slo(self.profile, self.slo_scale, round(summarize(list(trace))["mean_added_tokens"]))

    def config(self, placement: Placement, rule: ItlRule, slo: SLO) -> SimConfig:
        return SimConfig(Pool(self.profile, self.decode_replicas), Pool(self.profile, self.prefill_replicas), slo,
                         policy=self.policy, placement=placement, itl_rule=rule, seed=self.seed)  # fmt: skip

    @property
    def gpus(self) -> int:
        return self.profile.tp * (self.prefill_replicas + self.decode_replicas)


@dataclass(frozen=True)
class Row:
    placement: str
    itl_rule: str
    attainment: float  # rounds that met the SLO under the ITL rule, a fraction
    prefill_tokens: int  # prompt tokens the engines computed


def run_one(setup: Setup, rate: float, placement: Placement, rule: ItlRule) -> Row:
    """One simulation: ``placement`` on the trace at ``rate``, judged by ``rule``."""
    trace = setup.trace(rate)
    sim = Simulation(setup.config(placement, rule, setup.slo(trace)), trace)
    sim.run()
    report = sim.report()
    computed = sum(w.prefill_tokens for w in sim.workers.values())
    return Row(placement, rule, report.slo_attainment_by_rule[rule], computed)


def knee(setup: Setup, rates: Sequence[float]) -> float:
    """The first of ``rates`` (ascending) at which ``memory`` misses the mean-rule SLO in more
    than :data:`KNEE_MISS` of rounds; the last if it never does."""
    for rate in rates:
        if run_one(setup, rate, "memory", "mean").attainment < 1 - KNEE_MISS:
            return rate
    return rates[-1]


def run_placement(setup: Setup, rate: float, rules: Sequence[ItlRule], workers: int = 0) -> list[Row]:
    """Every placement under every rule at ``rate``, in parallel processes."""
    jobs = [(placement, rule) for rule in rules for placement in PLACEMENTS]
    with ProcessPoolExecutor(max_workers=workers or None) as pool:
        futures = [pool.submit(run_one, setup, rate, placement, rule) for placement, rule in jobs]
        return [f.result() for f in futures]


def table(rows: Sequence[Row]) -> str:
    """The rows as Markdown, with each placement's prefill tokens against ``memory``'s."""
    memory = {r.itl_rule: r.prefill_tokens for r in rows if r.placement == "memory"}
    lines = [
        "| placement | ITL rule | SLO attainment | prefill tokens | vs memory |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        share = r.prefill_tokens / memory[r.itl_rule] if memory.get(r.itl_rule) else float("nan")
        cells = (r.placement, r.itl_rule, f"{100 * r.attainment:.1f}%", f"{r.prefill_tokens:,}", f"{share:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out: Path, rows: Sequence[Row], setup: Setup, rate: float, title: str) -> list[Path]:
    """``out`` (JSON: ``{"rows": [...]}`` and the setup) and a Markdown table beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    about = {
        "model_profile": setup.profile.name, "gpus": setup.gpus, "prefill_replicas": setup.prefill_replicas,
        "decode_replicas": setup.decode_replicas, "workload": setup.workload, "agent_types": setup.agents.types,
        "tenants": setup.agents.tenants, "sessions": setup.sessions, "rate": rate, "seed": setup.seed,
        "policy": setup.policy, "slo_scale": setup.slo_scale,
    }  # fmt: skip
    out.write_text(json.dumps({"rows": [asdict(r) for r in rows], "setup": about}, indent=2) + "\n")
    markdown = out.with_suffix(".md")
    markdown.write_text(f"# {title}\n\n{table(rows)}\n")
    return [out, markdown]
