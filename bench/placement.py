"""`ampd bench placement`: where sessions bind and remote prefills run, by each placement
rule (rounds.placement), on a trace whose sessions share their agents' prompts, simulated.

An agent population (planner.trace.with_agents: K agent types, T tenants, 5-25k tokens
of system prompt and tool schemas per type) runs through one disaggregated deployment
at its knee - the lowest rate tried at which ``memory`` (AMPD's binding as published)
misses the SLO in more than :data:`KNEE_MISS` of rounds - once per placement and ITL
rule and trace seed. Each row gives the share of rounds that met the SLO and the prompt
tokens the engines computed (prefix-cache hits and pulled KV not counted): what the
engines' own caches saved under each rule. The rules' attainments lie within a point of
each other, less than one trace differs from another, so a verdict between them is read
over several seeds (the table's mean and range), never from one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import fmean

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
    seed: int  # the trace's


def run_one(setup: Setup, rate: float, placement: Placement, rule: ItlRule) -> Row:
    """One simulation: ``placement`` on the trace at ``rate``, judged by ``rule``."""
    trace = setup.trace(rate)
    sim = Simulation(setup.config(placement, rule, setup.slo(trace)), trace)
    sim.run()
    report = sim.report()
    computed = sum(w.prefill_tokens for w in sim.workers.values())
    return Row(placement, rule, report.slo_attainment_by_rule[rule], computed, setup.seed)


def knee(setup: Setup, rates: Sequence[float]) -> float:
    """The first of ``rates`` (ascending) at which ``memory`` misses the mean-rule SLO in more
    than :data:`KNEE_MISS` of rounds; the last if it never does."""
    for rate in rates:
        if run_one(setup, rate, "memory", "mean").attainment < 1 - KNEE_MISS:
            return rate
    return rates[-1]


def run_placement(
    setup: Setup, rate: float, rules: Sequence[ItlRule], seeds: Sequence[int], workers: int = 0
) -> list[Row]:
    """Every placement under every rule at ``rate``, on the trace of each seed, in parallel processes."""
    jobs = [
        (replace(setup, seed=seed), placement, rule) for seed in seeds for rule in rules for placement in PLACEMENTS
    ]
    with ProcessPoolExecutor(max_workers=workers or None) as pool:
        futures = [pool.submit(run_one, seeded, rate, placement, rule) for seeded, placement, rule in jobs]
        return [f.result() for f in futures]


@dataclass(frozen=True)
class Summary:
    """One placement under one rule over the seeds: the mean, the range, and the seeds on
    which it met the SLO in at least as many rounds as every other rule but ``memory``."""

    placement: str
    itl_rule: str
    attainment: float
    attainment_min: float
    attainment_max: float
    prefill_tokens: float
    best_on: int
    seeds: int


def summarize_rows(rows: Sequence[Row]) -> list[Summary]:
    out = []
    for rule in dict.fromkeys(r.itl_rule for r in rows):
        ruled = [r for r in rows if r.itl_rule == rule]
        seeds = sorted({r.seed for r in ruled})
        best = {s: max(r.attainment for r in ruled if r.seed == s and r.placement != "memory") for s in seeds}
        for placement in dict.fromkeys(r.placement for r in ruled):
            mine = [r for r in ruled if r.placement == placement]
            attained = [r.attainment for r in mine]
            out.append(Summary(
                placement, rule, fmean(attained), min(attained), max(attained),
                fmean(r.prefill_tokens for r in mine), sum(r.attainment >= best[r.seed] for r in mine), len(mine),
            ))  # fmt: skip
    return out


def table(rows: Sequence[Row]) -> str:
    """The rows over their seeds as Markdown: the mean attainment and its range, on how many
    seeds the placement was the best (``memory`` aside), and its mean prefill tokens
    against ``memory``'s."""
    summary = summarize_rows(rows)
    memory = {s.itl_rule: s.prefill_tokens for s in summary if s.placement == "memory"}
    lines = [
        "| placement | ITL rule | SLO attainment, mean (range) | best on seeds | prefill tokens, mean | vs memory |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in summary:
        share = s.prefill_tokens / memory[s.itl_rule] if memory.get(s.itl_rule) else float("nan")
        best = "-" if s.placement == "memory" else f"{s.best_on} of {s.seeds}"
        attained = f"{100 * s.attainment:.1f}% ({100 * s.attainment_min:.1f}-{100 * s.attainment_max:.1f})"
        cells = (s.placement, s.itl_rule, attained, best, f"{s.prefill_tokens:,.0f}", f"{share:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out: Path, rows: Sequence[Row], setup: Setup, rate: float, title: str) -> list[Path]:
    """``out`` (JSON: ``{"rows": [...]}`` and the setup) and a Markdown table beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    about = {
        "model_profile": setup.profile.name, "gpus": setup.gpus, "prefill_replicas": setup.prefill_replicas,
        "decode_replicas": setup.decode_replicas, "workload": setup.workload, "agent_types": setup.agents.types,
        "tenants": setup.agents.tenants, "sessions": setup.sessions, "rate": rate,
        "seeds": sorted({r.seed for r in rows}), "policy": setup.policy, "slo_scale": setup.slo_scale,
    }  # fmt: skip
    body = {"rows": [asdict(r) for r in rows], "summary": [asdict(s) for s in summarize_rows(rows)], "setup": about}
    out.write_text(json.dumps(body, indent=2) + "\n")
    markdown = out.with_suffix(".md")
    markdown.write_text(f"# {title}\n\n{table(rows)}\n")
    return [out, markdown]
