"""Offline planning: simulated tau coefficients, Eq. 5, and the deployment file.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), section 5 and
Appendix A. For a GPU type t, feasible TP degree n (the weights and a working KV cache
fit: perfmodel.memory) and replica count m, the simulator (planner.simulator) runs one
replica of degree n of a phase on the share of the trace one of m replicas gets (every
m-th session), with every prefill remote (``disagg``) so that each phase is measured on
its own work, and the other phase ample (that share of the cluster), so that it neither
starves nor floods the measured one. That gives

* tau_pre(t, n, m) = P95 prefill-phase latency (queue + prefill on the prefill worker) / TTFT_thres,
* tau_dec(t, n, m) = P95 per-round ITL / ITL_thres (each round's ITL by the ITL rule in
  force: its mean gap, its P95 gap or its longest, perfmodel.slo),

normalised by their SLOs so that a prefill bottleneck and a decode bottleneck compare
in Eq. 5's single Z (the paper leaves tau's unit open). Not every (t, n, m) is
simulated: planner.tau_search bounds the rest by monotonicity in m and simulates only
where Eq. 5's best could lie, planner.ilp solving Eq. 5 with SCIP on the way. Its best
configurations are finally simulated whole, with the serving policy, for their
predicted P95 TTFT and SLO attainment; a candidate with no more replicas of either
phase than another is not, as it cannot rank above that one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from perfmodel.catalog import GPUS, MODELS, TP_DEGREES
from perfmodel.memory import fits
from perfmodel.profile import PROFILES_DIR, Efficiency, Profile, load_profile
from perfmodel.roofline import DEFAULT_MEMORY, profile_name, roofline_profile
from perfmodel.slo import REFERENCE_PROMPT_TOKENS, SLO, ItlRule, derived_slo
from planner.ilp import Deployment, PoolOption, enumerate_deployments
from planner.simulator import Pool, SimConfig, SimReport, simulate
from planner.split_search import Climb
from planner.tau_search import Family, Sample, search
from planner.trace import TraceSession, subsample
from rounds.elastic import RolePlan
from rounds.engine.scheduler import SchedulerConfig
from rounds.policies import step_target_ms

Progress = Callable[[str], None]


def parse_gpus(spec: str, default_type: str = "H20") -> dict[str, int]:
    """``16`` (of ``default_type``) or ``H20=16,L40=8``."""
    if spec.strip().isdigit():
        pools = {default_type: int(spec)}
    else:
        pools = {}
        for part in spec.split(","):
            name, _, count = part.partition("=")
            if not count.strip().isdigit():
                raise ValueError(f"bad GPU pool {part!r}: write TYPE=COUNT, e.g. H20=16")
            pools[name.strip()] = int(count)
    unknown = [g for g in pools if g not in GPUS]
    if unknown:
        raise ValueError(f"unknown GPU types {unknown}; known: {', '.join(GPUS)}")
    if any(n < 1 for n in pools.values()):
        raise ValueError("every GPU pool needs at least one GPU")
    return pools


def parse_pool(spec: str) -> tuple[int, int]:
    """``TPxDP``, e.g. ``4x2`` - four-way tensor parallel, two replicas."""
    tp, sep, dp = spec.lower().partition("x")
    if not sep or not tp.isdigit() or not dp.isdigit() or int(tp) < 1 or int(dp) < 1:
        raise ValueError(f"bad pool {spec!r}: write TPxDP, e.g. 4x2")
    return int(tp), int(dp)


class ProfileBook:
    """Profiles by (GPU type, TP degree): given files first, then shipped, then derived. With
    an ``efficiency``, every profile not given is derived by the roofline at it (the
    calibrated constants, or a sweep of one of them), none shipped."""

    def __init__(self, model: str, given: Sequence[Profile] = (), efficiency: Efficiency | None = None) -> None:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
        self.model = MODELS[model]
        self.efficiency = efficiency
        self._given = {(p.gpu.name, p.tp): p for p in given if p.model.name == model}
        self._cache: dict[tuple[str, int], Profile] = {}

    def feasible(self, gpu: str) -> list[int]:
        return [n for n in TP_DEGREES if (gpu, n) in self._given or fits(self.model, GPUS[gpu], n, DEFAULT_MEMORY)]

    def get(self, gpu: str, tp: int) -> Profile:
        key = (gpu, tp)
        if key not in self._cache:
            if key in self._given:
                self._cache[key] = self._given[key]
            elif tp not in self.feasible(gpu):
                raise ValueError(f"{self.model.name} does not fit TP={tp} on {gpu} (weights plus a full-length KV)")
            else:
                shipped = PROFILES_DIR / f"{profile_name(self.model, GPUS[gpu], tp)}.json"
                if self.efficiency is not None:
                    self._cache[key] = roofline_profile(self.model, GPUS[gpu], tp, self.efficiency)
                elif shipped.exists():
                    self._cache[key] = load_profile(shipped)
                else:
                    self._cache[key] = roofline_profile(self.model, GPUS[gpu], tp)
        return self._cache[key]

    def reference_slo(self, gpu: str, scale: float, prompt_tokens: int = REFERENCE_PROMPT_TOKENS) -> SLO:
        """One SLO for the whole plan: scale x the unloaded latency at the smallest degree
        that fits on ``gpu`` (DistServe's convention; the same thresholds for every config)."""
        degrees = self.feasible(gpu)
        if not degrees:
            raise ValueError(f"{self.model.name} fits on no TP degree of {gpu}")
        return derived_slo(self.get(gpu, degrees[0]), scale, prompt_tokens)


@dataclass(frozen=True)
class Judging:
    """What the planner judges a deployment by: the profiles its engines run at (the
    book), the SLO a round must meet, the ITL rule its gaps are held to (perfmodel.slo)
    and the serving policy it runs. Every simulation the planner makes of a deployment
    is made and read under these; a measurement that routes its own way (the tau runs
    under ``disagg``, a pool's static splits under ``ampd-tail``) keeps its SLO and rule."""

    book: ProfileBook
    slo: SLO
    itl_rule: ItlRule = "mean"
    policy: str = "ampd"

    def pool(self, gpu: str, tp: int, replicas: int) -> Pool:
        """``replicas`` engines of degree ``tp`` on ``gpu``, at the book's profile."""
        return Pool(self.book.get(gpu, tp), replicas)

    def config(self, decode: Pool, prefill: Pool | None, **options: Any) -> SimConfig:
        """``decode`` and ``prefill`` simulated as judged: this SLO, ITL rule and policy;
        ``options`` are SimConfig's other fields (``policy`` among them, for a run that
        routes its own way)."""
        judged: dict[str, Any] = {"slo": self.slo, "policy": self.policy, "itl_rule": self.itl_rule}
        return SimConfig(decode=decode, prefill=prefill, **(judged | options))


@dataclass(frozen=True)
class TauSample:
    phase: str
    gpu: str
    tp: int
    replicas: int
    report: SimReport


def tau_families(judging: Judging, sessions: Sequence[TraceSession], capacity: Mapping[str, int]) -> list[Family]:
    """Every (phase, type, degree) with the replica counts that leave room for the other
    phase; prefill counts whose replicas `prefill_overwhelmed` shows far past the SLO are left out."""
    book, slo = judging.book, judging.slo
    degrees = {gpu: book.feasible(gpu) for gpu in capacity}
    if not any(degrees.values()):
        raise ValueError(f"{book.model.name} fits on no TP degree of {', '.join(capacity)}")
    smallest = min(d[0] for d in degrees.values() if d)  # GPUs the other phase needs at least
    families = []
    for gpu, count in capacity.items():
        for tp in degrees[gpu]:
            most = min(count // tp, (sum(capacity.values()) - smallest) // tp, len(sessions))
            counts = range(1, most + 1)
            profile = book.get(gpu, tp)
            fed = [m for m in counts if not prefill_overwhelmed(profile, list(subsample(sessions, m)), slo)]
            families += [Family(phase, gpu, tp, tuple(c)) for phase, c in (("prefill", fed), ("decode", counts)) if c]
    return families


def tau_run(
    judging: Judging, sessions: Sequence[TraceSession], capacity: Mapping[str, int], sample: Sample
) -> tuple[SimConfig, list[TraceSession]]:
    """One replica of ``sample``'s degree on its 1/m share of the trace, every prefill remote
    (``disagg``, whatever ``judging``'s policy) so that each phase is measured on its own
    work, the other phase ample."""
    phase, gpu, tp, replicas = sample
    one, ample = judging.pool(gpu, tp, 1), _ample(judging.book, capacity, replicas)
    decode, prefill = (ample, one) if phase == "prefill" else (one, ample)
    return judging.config(decode, prefill, policy="disagg"), list(subsample(sessions, replicas))


@dataclass(frozen=True)
class TauResult:
    options: list[PoolOption]  # simulated taus, and bounds where none was needed
    samples: list[TauSample]  # the simulations made
    best: list[Deployment]  # Eq. 5's best on them, every tau of theirs simulated
    solve_s: float  # SCIP's time, all solves together


def search_taus(
    judging: Judging,
    sessions: Sequence[TraceSession],
    capacity: Mapping[str, int],
    top: int,
    progress: Progress | None = None,
    jobs: int = 1,
) -> TauResult:
    """Eq. 5's ``top`` deployments with taus simulated only where they can lie (planner.tau_search)."""
    trace = list(sessions)
    samples: list[TauSample] = []

    def measure(wanted: Sequence[Sample]) -> list[float | None]:
        if progress:
            progress(f"tau: {len(wanted)} simulations of one replica on its share ({len(samples)} so far)")
        runs = [tau_run(judging, trace, capacity, s) for s in wanted]
        reports = simulate_all(runs, jobs)
        samples.extend(TauSample(*s, r) for s, r in zip(wanted, reports, strict=True))
        return [r.tau_prefill if s[0] == "prefill" else r.tau_decode for s, r in zip(wanted, reports, strict=True)]

    found = search(tau_families(judging, trace, capacity), measure, capacity, top)
    return TauResult(found.options, samples, found.best, found.solve_s)


def simulate_all(runs: Sequence[tuple[SimConfig, Sequence[TraceSession]]], jobs: int = 1) -> list[SimReport]:
    """``simulate`` each (config, sessions) run, ``jobs`` at a time in processes of their
    own; the longest traces start first, so that no process is left with the slowest run
    at the end. Reports come back in the runs' order, equal to running them one by one."""
    if jobs <= 1:
        return [simulate(config, trace) for config, trace in runs]
    order = sorted(range(len(runs)), key=lambda i: -len(runs[i][1]))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        reports = dict(zip(order, pool.map(_simulate_run, [runs[i] for i in order]), strict=True))
    return [reports[i] for i in range(len(runs))]


def _simulate_run(run: tuple[SimConfig, Sequence[TraceSession]]) -> SimReport:
    return simulate(*run)


def prefill_overwhelmed(profile: Profile, share: Sequence[TraceSession], slo: SLO) -> bool:
    """Whether one prefill replica is so far behind on ``share`` that simulating it would
    only confirm Eq. 5 cannot pick it: the sessions' first rounds alone, at the cheapest
    a token ever costs (the forward pass at its most efficient step size, no attention),
    leave more than twice the TTFT SLO of work queued when the last session arrives.
    Queued work then grows through the trace, so more than half of the first rounds wait
    past the SLO and the phase's P95 (tau_pre) is far above it. Simulating such replicas
    of a big cluster's smallest pools was most of its planning time."""
    if len(share) < 2:
        return False
    budget = SchedulerConfig().max_num_batched_tokens
    forward = profile.pieces.forward
    # alpha / x + beta on each piece: its lowest per-token cost is at one of its ends.
    steps = [1, *(p.upto for p in forward.pieces[:-1] if p.upto is not None and p.upto < budget), budget]
    per_token = min(forward(x) / x for x in steps)
    work = per_token * sum(s.rounds[0].input_tokens for s in share)
    span = max(s.arrival_s for s in share) - min(s.arrival_s for s in share)
    return work - span > 2 * slo.ttft_s


def _ample(book: ProfileBook, capacity: Mapping[str, int], share: int) -> Pool:
    """The other phase while one replica is measured on 1/``share`` of the trace: that
    share of the whole cluster at its largest degree, so that it is never the bottleneck
    it could be in any configuration that fits. (The whole cluster for every share made
    the cache set-up of idle replicas most of a large cluster's planning time.)"""
    gpu = max(capacity, key=lambda g: capacity[g])
    tp = book.feasible(gpu)[-1]
    return Pool(book.get(gpu, tp), max(1, math.ceil(sum(capacity.values()) / tp / share)))


def deployment_config(judging: Judging, deployment: Deployment) -> SimConfig:
    """The whole ``deployment`` simulated as judged (its policy among the rest)."""
    prefill, decode = (judging.pool(p.gpu, p.tp, p.replicas) for p in (deployment.prefill, deployment.decode))
    return judging.config(decode, prefill)


@dataclass(frozen=True)
class RankedPlan:
    deployment: Deployment
    predicted: SimReport
    eq5_rank: int = 0  # its place in the SCIP ranking (1 = Eq. 5's optimum; 0: found by the split search)


def dominates(more: Deployment, less: Deployment) -> bool:
    """Whether ``more`` is ``less`` with at least as many replicas in each phase (the same GPU
    types and degrees). It serves the same trace with more of everything, so its SLO
    attainment is at least ``less``'s (up to the noise of a P95 TTFT between two at 100%):
    the re-ranking spares ``less``'s simulation. At 256 GPUs that is three of Eq. 5's five."""
    same = all((a.gpu, a.tp) == (b.gpu, b.tp) for a, b in ((more.prefill, less.prefill), (more.decode, less.decode)))
    wider = more.prefill.replicas >= less.prefill.replicas and more.decode.replicas >= less.decode.replicas
    return same and wider and more != less


def attainment_key(report: SimReport) -> tuple[float, float]:
    """Sorts best first: higher simulated SLO attainment, then lower P95 TTFT."""
    return (-report.slo_attainment_rounds, report.ttft.p95_s or 0.0)


def by_attainment(plans: Sequence[RankedPlan]) -> list[RankedPlan]:
    return sorted(plans, key=lambda r: attainment_key(r.predicted))


@dataclass(frozen=True)
class PlanResult:
    ranked: list[RankedPlan]  # the recommendation first
    options: list[PoolOption]
    samples: list[TauSample]
    slo: SLO
    solve_s: float


def plan(
    judging: Judging,
    sessions: Sequence[TraceSession],
    capacity: Mapping[str, int],
    top: int = 3,
    candidates: int = 5,
    progress: Progress | None = None,
    jobs: int = 1,
) -> PlanResult:
    """Eq. 5's best ``candidates`` configurations, each then simulated whole with the
    serving policy; the best ``top`` by simulated SLO attainment come back.

    Eq. 5 is the paper's surrogate (P95 of the bottleneck phase, each phase measured on
    its own). It cannot see what the serving policy does across phases - AMPD runs
    prefills on decode workers when they have slack - so its optimum is a candidate,
    and the whole-system simulation of a handful of candidates makes the call. Where
    even the best of them misses rounds, the split search (planner.split_search) moves
    GPUs between the phases from there, simulated whole. The Eq. 5 rank stays in the
    result for comparison.
    """
    taus = search_taus(judging, sessions, capacity, max(top, candidates), progress, jobs)
    ranked = list(enumerate(taus.best, 1))
    judged = [(rank, d) for rank, d in ranked if not any(dominates(other, d) for _, other in ranked)]
    if progress:
        progress(f"predict {len(judged)} of Eq. 5's best {len(ranked)}, simulated whole (the rest have less of both)")
    runs = [(deployment_config(judging, d), sessions) for _, d in judged]
    reports = simulate_all(runs, jobs)
    simulated = [RankedPlan(d, report, rank) for (rank, d), report in zip(judged, reports, strict=True)]
    if by_attainment(simulated)[0].predicted.slo_attainment_rounds < 1.0:
        options = taus.options
        simulated += climb_splits(judging, sessions, options, capacity, simulated, progress, jobs)
    return PlanResult(by_attainment(simulated)[:top], taus.options, taus.samples, judging.slo, taus.solve_s)


def climb_splits(
    judging: Judging,
    sessions: Sequence[TraceSession],
    options: Sequence[PoolOption],
    capacity: Mapping[str, int],
    candidates: Sequence[RankedPlan],
    progress: Progress | None = None,
    jobs: int = 1,
) -> list[RankedPlan]:
    """planner.split_search from the best candidate of each pair of pools' (type, degree):
    the deployments it simulated whole on the way (Eq. 5 rank 0: not among Eq. 5's best)."""
    best: dict[tuple, RankedPlan] = {}
    for r in by_attainment(candidates):
        best.setdefault((r.deployment.prefill.pool, r.deployment.decode.pool), r)
    climbs = [Climb(r.deployment, attainment_key(r.predicted), ["decode", "prefill"]) for r in best.values()]
    known = {r.deployment: r.predicted for r in candidates}
    found: list[RankedPlan] = []
    while steps := [(c, d) for c in climbs if (d := c.step(options, capacity)) is not None]:
        fresh = list(dict.fromkeys(d for _, d in steps if d not in known))
        if progress:
            progress(f"split search: {len(fresh)} configurations simulated whole ({len(found)} so far)")
        runs = [(deployment_config(judging, d), sessions) for d in fresh]
        for d, report in zip(fresh, simulate_all(runs, jobs), strict=True):
            known[d] = report
            found.append(RankedPlan(d, report))
        for c, d in steps:
            c.moved(d, attainment_key(known[d]))
    return found


def exhaustive(
    judging: Judging,
    sessions: Sequence[TraceSession],
    options: Sequence[PoolOption],
    capacity: Mapping[str, int],
    progress: Progress | None = None,
    jobs: int = 1,
) -> list[RankedPlan]:
    """Every feasible configuration simulated whole, best SLO attainment first (the paper's
    Table 2 check of the planner; ties go to the lower P95 TTFT)."""
    deployments = enumerate_deployments(options, capacity)
    if progress:
        progress(f"validate: {len(deployments)} configurations simulated whole, {jobs} at a time")
    runs = [(deployment_config(judging, d), sessions) for d in deployments]
    return by_attainment([RankedPlan(d, report, rank) for rank, (d, report) in
                          enumerate(zip(deployments, simulate_all(runs, jobs), strict=True), 1)])  # fmt: skip


# -- the deployment file ---------------------------------------------------------------
HELM_PROFILE_DIR = "/etc/ampd/profiles"  # where the Helm chart mounts profiles a plan derived


class PhaseDeployment(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: str
    tp: int = Field(ge=1)
    replicas: int = Field(ge=1)
    profile: str = Field(description="shipped profile name or file the workers load")


class DeploymentFile(BaseModel):
    """What `ampd plan` decides, for `ampd up --deployment` and compose.yaml (via its .env
    twin): a prefill and a decode pool, or for an elastic policy one pool of engines whose
    roles the gateway assigns, with its role plan (planner.role_plan)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 2
    model: str
    policy: str
    prefill: PhaseDeployment | None = None
    decode: PhaseDeployment | None = None
    pool: PhaseDeployment | None = None
    role_plan: RolePlan | None = None
    ttft_slo_s: float
    itl_slo_s: float
    itl_rule: ItlRule = "mean"  # how the plan judged a round's ITL: the gateway's --itl-slo-metric
    predicted_slo_attainment: float
    predicted_p95_ttft_s: float | None
    z: float | None = None  # Eq. 5's objective (split deployments)

    @model_validator(mode="after")
    def _one_shape(self) -> DeploymentFile:
        split = self.prefill is not None and self.decode is not None and self.pool is None
        pool = self.pool is not None and self.prefill is None and self.decode is None
        if not (split or pool) or (self.role_plan is not None and not pool):
            raise ValueError("a deployment is a prefill and a decode pool, or one pool (with its role plan)")
        return self

    @property
    def step_target_ms(self) -> float:
        """The step time its engines keep to while they decode under its policy, SLO and ITL
        rule (rounds.policies.step_target, as the simulator judged it); 0: vLLM's own steps."""
        return step_target_ms(self.policy, SLO(self.ttft_slo_s, self.itl_slo_s), self.itl_rule)

    def env(self) -> str:
        """The same decision as docker compose variables (``--env-file``)."""
        lines: dict[str, object] = {"AMPD_MODEL": self.model, "AMPD_POLICY": self.policy,
                                    "AMPD_ITL_SLO_METRIC": self.itl_rule}  # fmt: skip
        if self.step_target_ms > 0:
            lines["AMPD_STEP_TARGET_MS"] = round(self.step_target_ms, 3)
        for name, phase in (("PREFILL", self.prefill), ("DECODE", self.decode), ("POOL", self.pool)):
            if phase is None:
                lines[f"{name}_REPLICAS"] = 0
                continue
            lines |= {f"{name}_GPU": phase.gpu, f"{name}_TP": phase.tp, f"{name}_REPLICAS": phase.replicas,
                      f"{name}_PROFILE": phase.profile}  # fmt: skip
        if self.role_plan is not None:  # JSON, quoted for docker compose
            lines["AMPD_ROLE_PLAN"] = f"'{role_plan_json(self.role_plan)}'"
        return "".join(f"{k}={v}\n" for k, v in lines.items())

    def helm_values(self, profile_files: Mapping[str, str] | None = None) -> dict:
        """The same decision as values for the Helm chart (deploy/helm/ampd): model and its
        weights, policy, each pool's GPU type, TP, replicas and profile (absent pools at 0
        replicas), the role plan and the SLOs. A profile given as a file (derived by the
        planner, not shipped in the images) travels in the values - its text from
        ``profile_files`` (path -> JSON) - and the engines read it from a ConfigMap mounted
        at HELM_PROFILE_DIR (gateways get profiles from the engines' registrations)."""
        values: dict = {"model": self.model, "policy": self.policy, "profiles": {}, "engines": {}}
        spec = MODELS.get(self.model)
        if spec is not None:
            values["engines"]["vllm"] = {"model": spec.hf_id}
        if self.step_target_ms > 0:
            values["engines"]["stepTargetMs"] = round(self.step_target_ms, 3)
        for name in ("prefill", "decode", "pool"):
            phase: PhaseDeployment | None = getattr(self, name)
            if phase is None:
                values[name] = {"replicas": 0}
                continue
            profile = phase.profile
            if profile.endswith(".json"):  # a file beside the deployment, not a shipped name
                file = Path(profile).name
                if profile_files is None or profile not in profile_files:
                    raise ValueError(f"profile file {profile} is not in the images: pass its text")
                values["profiles"][file] = profile_files[profile]
                profile = f"{HELM_PROFILE_DIR}/{file}"
            values[name] = {"gpu": phase.gpu, "tp": phase.tp, "replicas": phase.replicas, "profile": profile}
        plan = None if self.role_plan is None else json.loads(role_plan_json(self.role_plan))
        slo = {"ttftS": self.ttft_slo_s, "itlS": self.itl_slo_s, "itlMetric": self.itl_rule}
        values["gateway"] = {"rolePlan": plan, "slo": slo}
        return values

    def write(self, path: Path) -> Path:
        """Writes ``path`` (JSON) and ``path`` with ``.env`` beside it; returns the latter."""
        path.write_text(self.model_dump_json(indent=2) + "\n")
        env = path.with_suffix(".env")
        env.write_text(self.env())
        return env


def role_plan_json(plan: RolePlan) -> str:
    """The role plan as the gateway's ``--role-plan`` takes it (one line of JSON)."""
    return TypeAdapter(RolePlan).dump_json(plan).decode()


def deployment_file(judging: Judging, best: RankedPlan) -> DeploymentFile:
    """``best`` as `ampd plan` writes it, with the SLO, rule and policy it was judged by."""
    book, slo = judging.book, judging.slo

    def phase(option: PoolOption) -> PhaseDeployment:
        return PhaseDeployment(gpu=option.gpu, tp=option.tp, replicas=option.replicas,
                               profile=book.get(option.gpu, option.tp).name)  # fmt: skip

    d = best.deployment
    return DeploymentFile(
        model=book.model.name,
        policy=judging.policy,
        prefill=phase(d.prefill),
        decode=phase(d.decode),
        ttft_slo_s=slo.ttft_s,
        itl_slo_s=slo.itl_s,
        itl_rule=judging.itl_rule,
        predicted_slo_attainment=best.predicted.slo_attainment_rounds,
        predicted_p95_ttft_s=best.predicted.ttft.p95_s,
        z=d.z,
    )


def load_deployment(path: Path) -> DeploymentFile:
    return DeploymentFile.model_validate_json(path.read_text())
