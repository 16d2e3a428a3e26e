"""`ampd bench peers`: ampd against the routers users would pick instead, live, in front of
the same GPU-free engines, on the same shared-prefix agent trace.

N GPU-free engines (``ampd worker sim``, role ``both``, a KV cache small enough that the
agents' prompts do not all fit, all pinned to core 0) serve every arm in turn; each arm
replays the whole trace (bench.replay, as agent sessions) and is measured the same way:

* ``ampd-<placement>``: the ampd gateway, colocated (``--policy coloc``: each session's
  prefills on the engine that decodes it, as the routers do), binding new sessions by
  ``--placement`` (rounds.placement: ``memory``, ``ampd``, and the copies of the production
  rules, ``dynamo-kv``, ``llmd-prefix``, ``sglang-cache``), fed by the engines' KV events;
* ``vllm-router``: the vLLM project's router, ``--policy cache_aware``;
* ``sglang-router``: SGLang's model gateway (``sglang-router``, the SGLang project's
  build of its ``smg`` crate), ``--policy cache_aware``; ``smg``: the Shepherd Model
  Gateway (PyPI ``smg``), ``--policy cache_aware``;
* ``dynamo``: NVIDIA Dynamo's frontend with its KV router. It is started and asked for
  its models, and the reason it cannot serve these engines is recorded (:func:`probe_dynamo`).

``--deployment pd`` puts the same engines in prefill/decode disaggregation instead (the
first ``prefill_engines`` prefill, the rest decode; vLLM's NIXL hand-off, which the
GPU-free engine speaks) and races what fronts that:

* ``ampd-pd`` (AMPD's adaptive local/remote incremental prefill with TTFT-aware
  reordering, ``--policy ampd``), ``ampd-tail`` (its tail-aware routing) and
  ``ampd-disagg`` (every prefill remote, FIFO: disaggregation as served without AMPD),
  each placing by the KV index (``--placement ampd``), as vllm-router places prefills by
  its cache;
* ``vllm-router-pd``: vllm-router's vLLM P/D mode (``--vllm-pd-disaggregation
  --kv-connector nixl``, its default ``cache_aware`` policy), which prefills every request
  on a prefill engine and hands its KV to a decode engine with ``kv_transfer_params``.

SGLang's routers have a P/D mode for SGLang's own engines (their bootstrap hand-off), not
for vLLM's, so they are not arms of ``pd``.

The peers are installed from PyPI into bench/venvs/ (bench.peer_venvs) at run time. Every
arm starts cold: the engines' prefix caches are emptied between arms (vLLM's
``POST /reset_prefix_cache``, which also tells every KV-event subscriber), and each router
or gateway is a fresh process with nothing learnt. Session ids carry the arm's name.

Every request asks only in fields any OpenAI-compatible router forwards (bench.replay.
LengthDialect: ``max_tokens`` and ``ignore_eos``, no tools), so each streamed delta is one
token and the client times TTFT and every gap between tokens for every arm alike. Times
are wall clock multiplied by the engines' speed-up, so they read in the modelled hardware's
seconds, as the SLO does (derived as ``ampd bench placement`` derives it: ``scale`` x the
unloaded latency of the trace's mean round). A round meets the SLO by
``perfmodel.slo.SLO.met`` under each ITL rule; a round that failed, or was never sent
because its session stopped at a failed one, misses. The prefill tokens are the engines'
own count (``vllm:prompt_tokens`` less ``vllm:prefix_cache_hits``, summed over the
engines, over the arm).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import httpx
import numpy as np
from rich.console import Console

from ampd.local_redis import delete_prefix, ensure_redis, free_port
from ampd.processes import Child, spawn_gateway, spawn_sim_worker, wait_healthy
from bench.peer_venvs import REQUIREMENTS, ensure_venv
from bench.replay import LengthDialect, LiveRound, replay_sessions
from perfmodel.profile import load_profile
from perfmodel.slo import DEFAULT_SCALE, SLO, ItlRule, derived_slo
from planner.trace import WORKLOADS, Agents, TraceSession, generate, summarize, with_agents
from rounds.placement import PLACEMENTS
from surface.wire import STEP_LATENESS, bucket_quantile, bucket_totals, metric_totals, source_totals

Deployment = Literal["coloc", "pd"]
GATEWAY_ARMS = tuple(f"ampd-{p}" for p in PLACEMENTS)  # colocated, one per placement
PD_POLICIES = {"ampd-pd": "ampd", "ampd-tail": "ampd-tail", "ampd-disagg": "disagg"}  # arm -> the gateway's policy
PD_PLACEMENT = "ampd"  # the P/D arms', as vllm-router-pd places prefills by its cache
ROUTERS = ("vllm-router", "sglang-router", "smg")
ARMS: dict[str, tuple[str, ...]] = {
    "coloc": (*GATEWAY_ARMS, *ROUTERS, "dynamo"),
    "pd": (*PD_POLICIES, "vllm-router-pd"),
}
DEFAULT_ARMS = {"coloc": "ampd-memory,ampd-ampd,vllm-router,sglang-router,dynamo",
                "pd": "ampd-pd,ampd-disagg,vllm-router-pd"}  # fmt: skip
# The prefill tokens of every arm are set against this one's.
BASELINES: dict[str, str] = {"coloc": "ampd-memory", "pd": "ampd-disagg"}
VENV = {"vllm-router": "vllm-router", "vllm-router-pd": "vllm-router", "sglang-router": "sglang-router",
        "smg": "smg", "dynamo": "ai-dynamo"}  # fmt: skip
PROMPT_TOKENS = "vllm:prompt_tokens_total"
CACHE_HITS = "vllm:prefix_cache_hits_total"
REQUESTS = "vllm:request_success_total"
DYNAMO_FRONTEND = ("-m", "dynamo.frontend", "--router-mode", "kv", "--discovery-backend", "file",
                   "--request-plane", "tcp", "--event-plane", "zmq")  # fmt: skip


@dataclass(frozen=True)
class PeersSetup:
    """The engines and the trace every arm runs."""

    engines: int = 3
    sessions: int = 60
    rate: float = 0.25  # sessions per modelled second
    workload: str = "toolbench"
    agents: int = 12
    tenants: int = 2
    seed: int = 0
    profile: str = "llama-3.1-70b_h20_tp4"
    speed: float = 5.0  # the engines run this many times faster than the modelled hardware
    num_blocks: int = 10_625  # per engine: 170k tokens of KV, less than the agents' prompts together
    block_size: int = 16
    max_model_len: int = 40_960
    slo_scale: float = DEFAULT_SCALE
    policy: str = "coloc"  # the gateway's: every prefill on the session's engine, as behind a router
    prefill_slots: int = 1  # the gateway's default
    rules: tuple[ItlRule, ...] = ("mean", "p95")
    deployment: Deployment = "coloc"
    prefill_engines: int = 1  # under ``pd``: the first ones prefill, the rest decode

    def roles(self) -> list[str]:
        """Each engine's role."""
        if self.deployment == "coloc":
            return ["both"] * self.engines
        return ["prefill"] * self.prefill_engines + ["decode"] * (self.engines - self.prefill_engines)

    def trace(self) -> list[TraceSession]:
        plain = generate(WORKLOADS[self.workload], self.sessions, self.rate, self.seed)
        return with_agents(plain, Agents(self.agents, self.tenants), self.seed)

    def slo(self, trace: Sequence[TraceSession]) -> SLO:
        """In the modelled hardware's seconds: ``slo_scale`` x the unloaded latency of the
        trace's mean round (bench.placement.Setup.slo)."""
        mean_round = round(summarize(list(trace))["mean_added_tokens"])
        return derived_slo(load_profile(self.profile), self.slo_scale, mean_round)


@dataclass(frozen=True)
class Row:
    router: str
    itl_rule: str
    attainment: float  # the trace's rounds that met the SLO, a fraction (failed and lost rounds miss)
    ttft_p50_ms: float | None  # client side, modelled ms (wall x speed), over the rounds completed
    ttft_p95_ms: float | None
    prefill_tokens: int  # prompt tokens the engines computed (prefix-cache hits and pulled KV not counted)
    failed: int  # requests that failed
    lost: int  # rounds never sent: their session stopped at a failed request
    rounds: int  # the trace's
    deployment: str = "coloc"
    engine: str = "sim"
    seed: int = 0
    initial_ttft_ms: tuple[float | None, float | None] = (None, None)  # P50, P95 of sessions' first rounds
    incremental_ttft_ms: tuple[float | None, float | None] = (None, None)  # ... of the rounds after
    gap_p95_ms: float | None = None  # P95 over every gap between two tokens the client received
    simulated_attainment: float | None = None  # the simulator's, for the same arm (gateway arms)
    # The engines' step lateness, wall ms, P50 and P95 (bucket bounds): a race is fair only
    # where the engines kept their modelled pace beside the router under test.
    step_lateness_ms: tuple[float | None, float | None] = (None, None)


@dataclass(frozen=True)
class Counters:
    """The engines' own counters, one entry per engine."""

    prompt_tokens: tuple[float, ...]
    cache_hits: tuple[float, ...]
    requests: tuple[float, ...]
    computed_tokens: tuple[float, ...] = ()  # ``local_compute`` prompt tokens (surface.wire.PROMPT_SOURCES)
    lateness: tuple[tuple[float, float], ...] = ()  # all engines' steps: (bucket bound s, cumulative count)

    def minus(self, before: Counters) -> Counters:
        def less(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(x - y for x, y in zip(a, b, strict=True))

        late = tuple((le, n - m) for (le, n), (_, m) in zip(self.lateness, before.lateness, strict=True))
        return Counters(less(self.prompt_tokens, before.prompt_tokens), less(self.cache_hits, before.cache_hits),
                        less(self.requests, before.requests), less(self.computed_tokens, before.computed_tokens),
                        late)  # fmt: skip

    def step_lateness_s(self, q: float) -> float | None:
        """The engines' step lateness at quantile ``q``, wall seconds, as coarse as the
        histogram's buckets: whether the GPU-free engines kept the modelled pace."""
        return bucket_quantile(dict(self.lateness), q)

    @property
    def computed(self) -> int:
        """Prompt tokens the engines prefilled: by their own count where they keep one, else
        every prompt token less the prefix-cache hits (which, under prefill/decode
        disaggregation, would count a pulled prompt twice)."""
        if self.computed_tokens:
            return round(sum(self.computed_tokens))
        return round(sum(self.prompt_tokens) - sum(self.cache_hits))


@dataclass(frozen=True)
class ArmRun:
    """One arm's replay of the trace."""

    router: str
    rounds: list[LiveRound]
    failures: dict[str, str]  # session id -> its failed request's error
    expected_rounds: int
    counters: Counters  # over the arm
    wall_s: float


# -- the measures (pure) ----------------------------------------------------------------------
def _percentiles(values_ms: Sequence[float]) -> tuple[float | None, float | None]:
    """P50 and P95, None where there is nothing to read."""
    if not values_ms:
        return None, None
    p50, p95 = np.percentile(values_ms, (50, 95))
    return float(p50), float(p95)


def rows(run: ArmRun, slo: SLO, speed: float, rules: Sequence[ItlRule], deployment: str = "coloc", seed: int = 0,
         simulated: Mapping[str, float] | None = None) -> list[Row]:  # fmt: skip
    """``run`` judged by ``slo`` (modelled seconds) under each ITL rule; its wall-clock times
    are multiplied by ``speed`` first. ``simulated``: the simulator's attainment by rule."""
    scaled = speed * 1e3
    p50, p95 = _percentiles([r.ttft_s * scaled for r in run.rounds])
    initial = _percentiles([r.ttft_s * scaled for r in run.rounds if r.round == 0])
    incremental = _percentiles([r.ttft_s * scaled for r in run.rounds if r.round > 0])
    gap_p95 = _percentiles([g * scaled for r in run.rounds for g in r.gaps])[1]
    lateness = tuple(None if (s := run.counters.step_lateness_s(q)) is None else 1e3 * s for q in (0.5, 0.95))
    failed = len(run.failures)
    lost = max(0, run.expected_rounds - len(run.rounds) - failed)
    out = []
    for rule in rules:
        met = sum(slo.met(r.ttft_s * speed, None if r.itl(rule) is None else r.itl(rule) * speed) for r in run.rounds)
        attainment = met / run.expected_rounds if run.expected_rounds else 0.0
        out.append(Row(run.router, rule, attainment, p50, p95, run.counters.computed, failed, lost,
                       run.expected_rounds, deployment, "sim", seed, initial, incremental, gap_p95,
                       None if simulated is None else simulated.get(rule), lateness))  # fmt: skip
    return out


def markdown(table_rows: Sequence[Row], failures: dict[str, str], title: str = "", deployment: str = "coloc") -> str:
    """The rows as Markdown, each arm's prefill tokens against its deployment's baseline
    (:data:`BASELINES`), and the arms that could not run, with why."""
    baseline = BASELINES[deployment]
    base = {r.itl_rule: r.prefill_tokens for r in table_rows if r.router == baseline}

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    def late(v: float | None) -> str:
        return "-" if v is None else f"<= {v:g}"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    lines = [f"# {title}\n"] if title else []
    lines += ["| router | ITL rule | SLO attainment (simulated) | TTFT p50 / p95 (ms) | initial TTFT p50 / p95 | "
              f"incremental TTFT p50 / p95 | P95 gap (ms) | prefill tokens computed | vs {baseline} | failed / lost | "
              "engines' step lateness p50 / p95 (wall ms) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in table_rows:
        share = f"{r.prefill_tokens / base[r.itl_rule]:.2f}x" if base.get(r.itl_rule) else "-"
        lines.append(f"| {r.router} | {r.itl_rule} | {pct(r.attainment)} ({pct(r.simulated_attainment)}) | "
                     f"{ms(r.ttft_p50_ms)} / {ms(r.ttft_p95_ms)} | {ms(r.initial_ttft_ms[0])} / "
                     f"{ms(r.initial_ttft_ms[1])} | {ms(r.incremental_ttft_ms[0])} / {ms(r.incremental_ttft_ms[1])} | "
                     f"{ms(r.gap_p95_ms)} | {r.prefill_tokens:,} | {share} | {r.failed} / {r.lost} | "
                     f"{late(r.step_lateness_ms[0])} / {late(r.step_lateness_ms[1])} |")  # fmt: skip
    lines += [f"\n{arm} could not be run: {why}" for arm, why in failures.items()]
    return "\n".join(lines) + "\n"


def peer_argv(peer: str, venv: Path, port: int, workers: Sequence[str], metrics_port: int,
              prefills: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """A router in front of ``workers``, by its cache-aware policy; ``vllm-router-pd``: in
    front of the ``prefills`` and the decode engines ``workers``, in its vLLM P/D mode with
    its default policy."""
    if peer == "vllm-router-pd":
        if not prefills:
            raise ValueError("vllm-router-pd needs prefill engines")
        return [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                "--vllm-pd-disaggregation", *(a for url in prefills for a in ("--prefill", url)),
                *(a for url in workers for a in ("--decode", url)), "--kv-connector", "nixl",
                "--prometheus-port", str(metrics_port), "--log-level", "warning"]  # fmt: skip
    if peer == "vllm-router":
        return [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                *workers, "--policy", "cache_aware", "--prometheus-port", str(metrics_port),
                "--log-level", "warning"]  # fmt: skip
    if peer in ("sglang-router", "smg"):
        return [str(venv / "bin" / peer), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                *workers, "--policy", "cache_aware", "--prometheus-port", str(metrics_port),
                "--log-level", "warn"]  # fmt: skip
    raise ValueError(f"unknown peer {peer!r}")


# -- the engines --------------------------------------------------------------------------------
def read_counters(urls: Sequence[str]) -> Counters:
    pages = [httpx.get(f"{url}/metrics", timeout=30).text for url in urls]
    totals = [metric_totals(page) for page in pages]
    return Counters(tuple(t.get(PROMPT_TOKENS, 0.0) for t in totals), tuple(t.get(CACHE_HITS, 0.0) for t in totals),
                    tuple(t.get(REQUESTS, 0.0) for t in totals),
                    tuple(source_totals(page)["local_compute"] for page in pages),
                    _summed_buckets([bucket_totals(page, STEP_LATENESS) for page in pages]))  # fmt: skip


def _summed_buckets(histograms: Sequence[dict[float, float]]) -> tuple[tuple[float, float], ...]:
    bounds = sorted({le for h in histograms for le in h})
    return tuple((le, sum(h.get(le, 0.0) for h in histograms)) for le in bounds)


def reset_caches(urls: Sequence[str], timeout_s: float = 120.0) -> None:
    """Every engine's prefix cache emptied, once no block is in use (vLLM refuses till then)."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while not httpx.post(f"{url}/reset_prefix_cache", timeout=30).json().get("success"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} still held KV blocks {timeout_s:.0f} s after the arm")
            time.sleep(0.2)


@contextlib.contextmanager
def engines(setup: PeersSetup, registry: Sequence[str], state: Path) -> Iterator[list[Child]]:
    core = 0 if (os.cpu_count() or 1) > 1 else None
    options = ["--profile", setup.profile, "--speed", str(setup.speed), "--num-blocks", str(setup.num_blocks),
               "--block-size", str(setup.block_size), "--max-model-len", str(setup.max_model_len),
               "--enable-prompt-tokens-details", *registry]  # fmt: skip
    children = []
    try:
        for i, role in enumerate(setup.roles()):
            port = free_port()
            children.append(spawn_sim_worker(f"engine-{i}", port, [*options, "--role", role],
                                             log=state / f"engine-{i}.log", cpu=core))  # fmt: skip
        if (dead := wait_healthy(children, timeout_s=120)) is not None:
            raise RuntimeError(f"{dead.name} did not start; see {state}/{dead.name}.log")
        yield children
    finally:
        for child in children:
            child.stop()


# -- the arms -----------------------------------------------------------------------------------
def _wait_serving(url: str, model: str, child: Child, log: Path, timeout_s: float = 120.0) -> None:
    """Until a one-token chat completion comes back through ``url`` (a router is up before
    it has checked its workers)."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "messages": [{"role": "user", "content": "ready"}], "max_tokens": 1}
    while True:
        if child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited: {log.read_text(errors='replace')[-600:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} served no request within {timeout_s:.0f} s: "
                               f"{log.read_text(errors='replace')[-600:]}")  # fmt: skip
        time.sleep(0.2)


def gateway_options(arm: str, setup: PeersSetup) -> list[str] | None:
    """The ampd gateway's options for ``arm``; None for a peer's arm."""
    common = ["--prefill-slots", str(setup.prefill_slots), "--max-queue", "4096"]
    if arm in GATEWAY_ARMS:
        return ["--policy", setup.policy, "--placement", arm.removeprefix("ampd-"), *common]
    if arm in PD_POLICIES:  # placed by the KV index: Eq. 2 sees each prefill engine's true cached prefix
        return ["--policy", PD_POLICIES[arm], "--placement", PD_PLACEMENT, *common]
    return None


@contextlib.contextmanager
def serving(arm: str, setup: PeersSetup, workers: Sequence[str], model: str, registry: Sequence[str],
            state: Path) -> Iterator[str]:  # fmt: skip
    """The arm started in front of the engines; its URL."""
    log = state / f"{arm}.log"
    options = gateway_options(arm, setup)
    if options is not None:
        child = spawn_gateway(arm, free_port(), [*registry, *options], log)
    else:
        venv = ensure_venv(VENV[arm])
        roles = setup.roles()
        decodes = [url for url, role in zip(workers, roles, strict=True) if role != "prefill"]
        prefills = [url for url, role in zip(workers, roles, strict=True) if role == "prefill"]
        argv = peer_argv(arm, venv, port := free_port(), decodes, free_port(), prefills)
        child = Child(arm, f"http://127.0.0.1:{port}", subprocess.Popen(argv, stdout=log.open("ab"),
                                                                        stderr=subprocess.STDOUT))  # fmt: skip
    try:
        if options is not None:  # a cache placement's index must follow every engine before the trace starts
            _wait_indexed(child, 0 if arm == "ampd-memory" else len(workers))
        _wait_serving(child.url, model, child, log)
        yield child.url
    finally:
        child.stop()


def _wait_indexed(child: Child, engines: int, timeout_s: float = 120.0) -> None:
    """Until the gateway is ready and its KV index follows ``engines`` engines (under
    ``memory`` it keeps none)."""
    if wait_healthy([child], timeout_s=timeout_s, path="/readyz") is not None:
        raise RuntimeError(f"{child.name} did not become ready")
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            view = httpx.post(f"{child.url}/v1/engines/kv-index", json={"token_ids": []}, timeout=10).json()
            if len(view["engines"]) >= engines:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name}'s KV index did not follow the {engines} engines")
        time.sleep(0.2)


def run_arm(arm: str, url: str, trace: Sequence[TraceSession], setup: PeersSetup, workers: Sequence[str],
            model: str, on_round=lambda _: None) -> ArmRun:  # fmt: skip
    sessions = [s.model_copy(update={"session_id": f"{arm}-{s.session_id}"}) for s in trace]
    before, started = read_counters(workers), time.perf_counter()
    done, failures = asyncio.run(replay_sessions(url, sessions, setup.speed, on_round, LengthDialect(model)))
    wall = time.perf_counter() - started
    counters = read_counters(workers).minus(before)
    return ArmRun(arm, done, failures, sum(len(s.rounds) for s in trace), counters, wall)


def probe_dynamo(state: Path, timeout_s: float = 120.0) -> str:
    """Why Dynamo's frontend is not an arm, as this run found it: it is installed and started
    on this host, and asked which models it serves."""
    try:
        venv = ensure_venv(VENV["dynamo"])
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        return f"ai-dynamo did not install: {exc}"
    port, log = free_port(), state / "dynamo.log"
    argv = [str(venv / "bin" / "python"), *DYNAMO_FRONTEND, "--http-host", "127.0.0.1", "--http-port", str(port)]
    env = {**os.environ, "DYN_FILE_KV": str((state / "dynamo-store").resolve())}
    process = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    child = Child("dynamo", f"http://127.0.0.1:{port}", process)
    try:
        if wait_healthy([child], timeout_s=timeout_s) is not None:
            return (
                f"its frontend did not answer /health within {timeout_s:.0f} s: "
                + log.read_text(errors="replace")[-600:]
            )
        models = httpx.get(f"{child.url}/v1/models", timeout=10).json().get("data", [])
    finally:
        child.stop()
    return (
        f"its frontend (ai-dynamo 1.6.1, `python {' '.join(DYNAMO_FRONTEND)}`) runs on one host without etcd or "
        f"NATS and answered /health, but served {len(models)} models: it routes only to workers registered through "
        "Dynamo's runtime (dynamo.vllm, dynamo.sglang, dynamo.trtllm, or a worker written with "
        "dynamo.llm.register_llm that takes the frontend's token ids and relays its engine's KV events), and has no "
        "option to name an OpenAI-compatible HTTP engine as a worker. Fronting these engines needs such a worker per "
        "engine, written for them. (`pip install ai-dynamo==1.6.1` itself fails where only PyPI is reachable: its "
        "requirement aisimulate downloads its wheel from NVIDIA's own index; it is installed here without it.)"
    )


def simulated(setup: PeersSetup, trace: Sequence[TraceSession], slo: SLO, arms: Sequence[str]) -> dict:
    """The gateway arms' placements on the same trace and engines, simulated (planner.simulator):
    what the live rows can be held against."""
    from planner.simulator import Pool, SimConfig, Simulation
    from rounds.engine.scheduler import SchedulerConfig

    profile, out = load_profile(setup.profile), {}
    scheduler = SchedulerConfig(block_size=setup.block_size, num_blocks=setup.num_blocks)
    decode = Pool(profile, setup.roles().count("decode") or setup.engines)
    prefill = Pool(profile, setup.prefill_engines) if setup.deployment == "pd" else None
    for arm in (a for a in arms if a in GATEWAY_ARMS or a in PD_POLICIES):
        if arm in PD_POLICIES:
            policy, placement = PD_POLICIES[arm], PD_PLACEMENT
        else:
            policy, placement = setup.policy, arm.removeprefix("ampd-")
        config = SimConfig(decode, prefill, slo, policy=policy, placement=placement,  # type: ignore[arg-type]
                           scheduler=scheduler, seed=setup.seed, prefill_slots=setup.prefill_slots)  # fmt: skip
        sim = Simulation(config, list(trace))
        sim.run()
        report = sim.report()
        out[arm] = {"attainment": {rule: report.slo_attainment_by_rule[rule] for rule in setup.rules},
                    "prefill_tokens": sum(w.prefill_tokens for w in sim.workers.values())}  # fmt: skip
    return out


# -- the run ------------------------------------------------------------------------------------
def _one_arm(console: Console, arm: str, trace: Sequence[TraceSession], setup: PeersSetup, workers: Sequence[str],
             model: str, registry: Sequence[str], state: Path) -> ArmRun:  # fmt: skip
    rounds, count = sum(len(s.rounds) for s in trace), [0]
    status = console.status(f"{arm}: starting")

    def heard(_: LiveRound) -> None:
        count[0] += 1
        status.update(f"{arm}: {count[0]}/{rounds} rounds")

    with status, serving(arm, setup, workers, model, registry, state) as url:
        status.update(f"{arm}: {len(trace)} sessions")
        return run_arm(arm, url, trace, setup, workers, model, heard)


def run_peers_bench(console: Console, setup: PeersSetup, arms: Sequence[str], out: Path | None) -> int:
    known = ARMS[setup.deployment]
    unknown = [a for a in arms if a not in known]
    if unknown or not arms:
        console.print(f"[red]unknown arms {unknown} for --deployment {setup.deployment}; known: "
                      f"{', '.join(known)}[/red]")  # fmt: skip
        return 2
    if setup.deployment == "pd" and not 0 < setup.prefill_engines < setup.engines:
        console.print(f"[red]--deployment pd needs 1 to {setup.engines - 1} prefill engines of {setup.engines}[/red]")
        return 2
    trace, started = setup.trace(), time.perf_counter()
    slo = setup.slo(trace)
    rounds = sum(len(s.rounds) for s in trace)
    with console.status("simulating the gateway's arms"):
        predicted = simulated(setup, trace, slo, arms)
    console.print(f"{len(trace)} sessions, {rounds} rounds, {setup.agents} agent types x {setup.tenants} tenants; "
                  f"SLO TTFT {slo.ttft_s * 1e3:,.0f} ms, ITL {slo.itl_s * 1e3:.1f} ms ({setup.profile}, modelled; "
                  f"engines at {setup.speed:g}x)")  # fmt: skip
    prefix = f"bench-peers-{uuid.uuid4().hex[:8]}"
    state = Path(".ampd") / prefix
    state.mkdir(parents=True, exist_ok=True)
    redis = ensure_redis(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"), state / "redis")
    registry = ["--redis-url", redis.url, "--redis-prefix", prefix]
    runs: list[ArmRun] = []
    table_rows: list[Row] = []
    failures: dict[str, str] = {}
    load = os.getloadavg()
    try:
        with engines(setup, registry, state) as children:
            workers = [c.url for c in children]
            model = httpx.get(f"{workers[0]}/v1/models", timeout=30).json()["data"][0]["id"]
            if (os.cpu_count() or 1) > 1:
                os.sched_setaffinity(0, {1})  # the load generator and what it starts: off the engines' core
            for arm in arms:
                if arm == "dynamo":
                    with console.status("installing and starting Dynamo's frontend"):
                        failures[arm] = probe_dynamo(state)
                    console.print(f"[yellow]dynamo: {failures[arm]}[/yellow]")
                    continue
                try:
                    run = _one_arm(console, arm, trace, setup, workers, model, registry, state)
                    runs.append(run)
                    brief = rows(run, slo, setup.speed, setup.rules, setup.deployment, setup.seed,
                                 predicted.get(arm, {}).get("attainment"))  # fmt: skip
                    table_rows += brief
                    console.print(f"{arm}: {run.wall_s:.0f} s, prefill {run.counters.computed:,} tokens, "
                                  + ", ".join(f"{r.itl_rule} {r.attainment:.1%}" for r in brief)
                                  + (f", {len(run.failures)} failed" if run.failures else ""))  # fmt: skip
                except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                    failures[arm] = str(exc)
                    console.print(f"[yellow]{arm} could not be run: {exc}[/yellow]")
                finally:
                    reset_caches(workers)
    finally:
        delete_prefix(redis.url, prefix)
        redis.stop()
    wall = time.perf_counter() - started
    decoders = setup.engines - setup.prefill_engines
    engines_are = (f"{setup.engines} GPU-free engines" if setup.deployment == "coloc"
                   else f"{setup.prefill_engines} prefill + {decoders} decode GPU-free engines")  # fmt: skip
    title = (f"{len(trace)} {setup.workload} sessions ({setup.agents} agent types x {setup.tenants} tenants) at "
             f"{setup.rate:g}/s on {engines_are} ({setup.profile} at {setup.speed:g}x, "
             f"{setup.num_blocks * setup.block_size:,} KV tokens each), live ({wall / 60:.0f} min on "
             f"{os.cpu_count()} cores)")  # fmt: skip
    report = markdown(table_rows, failures, title, setup.deployment)
    console.print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "setup": {**asdict(setup), "rules": list(setup.rules)},
            "slo_modelled": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
            "trace": summarize(trace) | {"rounds": rounds},
            "requirements": {VENV[a]: REQUIREMENTS[VENV[a]] for a in arms if a in VENV},
            "load_average_before": load, "load_average_after": os.getloadavg(), "wall_s": wall,
            "rows": [asdict(r) for r in table_rows],
            "arms": [{"router": r.router, "wall_s": r.wall_s, "completed_rounds": len(r.rounds),
                      "prompt_tokens": round(sum(r.counters.prompt_tokens)),
                      "cache_hit_tokens": round(sum(r.counters.cache_hits)),
                      "requests_by_engine": [round(x) for x in r.counters.requests],
                      "failures": dict(list(r.failures.items())[:5])} for r in runs],
            "simulated": predicted,
            "failures": failures,
        }  # fmt: skip
        out.write_text(json.dumps(document, indent=2) + "\n")
        out.with_suffix(".md").write_text(report)
        console.print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
