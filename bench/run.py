"""`ampd bench run`: a trace replayed live, next to the simulator's prediction for it.

Live: Redis, GPU-free workers (``ampd worker sim``) running ``speed`` times faster than
the modelled GPU, and the gateway with the chosen policy; bench.replay drives one agent
session per trace session (the round, the tool's latency, the tool result, the next
round). Wall-clock latencies are multiplied by ``speed`` to compare with the simulator's
virtual time, and judged against the modelled SLO. The same trace then runs through
planner.simulator on the same deployment. The bar for agreement (the planner issue's):
SLO attainment within 5 points and P95 TTFT within 10%.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ampd.local_redis import NoRedis, delete_prefix, ensure_redis, free_port
from ampd.processes import Child, spawn_gateway, spawn_sim_worker, wait_healthy
from ampd.stack import STATE_DIR
from bench.replay import LiveRound, read_back, replay_sessions, with_gateway_tails
from perfmodel.profile import load_profile
from perfmodel.slo import SLO, ItlRule, derived_slo
from planner.plan import role_plan_json
from planner.role_plan import opening_load
from planner.simulator import Pool, SimConfig, SimReport, simulate
from planner.trace import TraceSession
from rounds.elastic import RolePlan
from rounds.policies import POLICIES, step_target

# Its own registry prefix per run: two runs sharing a Redis (parallel tests, two operators)
# would otherwise route to each other's workers and delete each other's keys at the end.
PREFIX = f"ampd-bench-run-{os.getpid()}"
COLOCATED = ("coloc", "continuum")
BAR_POINTS, BAR_REL = 5.0, 0.10


@dataclass(frozen=True)
class LiveSetup:
    profile: str
    speed: float
    policy: str
    prefill_replicas: int
    decode_replicas: int
    base_port: int  # the gateway's; the workers take free ones
    redis_url: str
    itl_rule: ItlRule = "mean"
    pool_replicas: int = 0  # an elastic policy's engines, registered as `both`
    role_plan: RolePlan | None = None

    def check(self) -> None:
        policy = POLICIES[self.policy]
        if policy.on_pool:
            if self.pool_replicas < 1 or self.prefill_replicas or self.decode_replicas:
                raise ValueError(f"{self.policy} runs on a pool: pass --pool N with --prefill-replicas 0 "
                                 "--decode-replicas 0")  # fmt: skip
            if policy.elastic is not None and self.speed != 1:  # its controller keeps the wall clock's time
                raise ValueError(f"{self.policy} compares with the simulator at --speed 1 only")
            if policy.elastic is None and self.role_plan is not None:
                raise ValueError("a role plan is for an elastic policy")
            return
        if self.pool_replicas or self.role_plan is not None:
            raise ValueError("--pool is for elastic policies and dynaserve, a role plan for elastic ones")
        if self.policy in COLOCATED and self.prefill_replicas:
            raise ValueError(f"{self.policy} serves on decode workers only: pass --prefill-replicas 0")
        if self.policy not in COLOCATED and not self.prefill_replicas:
            raise ValueError(f"{self.policy} needs at least one prefill worker")
        if self.decode_replicas < 1 or self.speed <= 0:
            raise ValueError("need at least one decode worker and a positive speed")

    @property
    def roles(self) -> list[str]:
        return ["prefill"] * self.prefill_replicas + ["decode"] * self.decode_replicas + ["both"] * self.pool_replicas


def live_summary(rounds: Sequence[LiveRound], slo: SLO, speed: float, rule: ItlRule = "mean") -> dict:
    """Wall-clock rounds in modelled seconds, judged against the modelled SLO by ``rule``."""
    ttft = np.array([r.ttft_s * speed for r in rounds])
    itl = [r.mean_itl_s * speed for r in rounds if r.mean_itl_s is not None]
    met = [slo.met(r.ttft_s * speed, None if r.itl(rule) is None else r.itl(rule) * speed) for r in rounds]
    return {
        "rounds": len(rounds),
        "slo_attainment_rounds": sum(met) / len(met),
        "ttft_p95_s": float(np.percentile(ttft, 95)),
        "ttft_mean_s": float(ttft.mean()),
        "itl_p95_s": float(np.percentile(itl, 95)) if itl else None,
    }


def sim_summary(report: SimReport) -> dict:
    return {
        "rounds": report.rounds,
        "slo_attainment_rounds": report.slo_attainment_rounds,
        "ttft_p95_s": report.ttft.p95_s,
        "ttft_mean_s": report.ttft.mean_s,
        "itl_p95_s": report.itl.p95_s,
        "local_share_incremental": report.local_share_incremental,
        "split_share": report.split_share,
    }


@contextlib.contextmanager
def live_stack(setup: LiveSetup, step_target_s: float = 0.0) -> Iterator[tuple[str, str]]:
    """Redis, the workers (keeping their steps to ``step_target_s`` while they decode) and
    the gateway, registered and ready; yields the gateway's and Redis's URLs."""
    STATE_DIR.mkdir(exist_ok=True)
    redis = ensure_redis(setup.redis_url, STATE_DIR / "redis-bench-run")
    registry = ["--redis-url", redis.url, "--redis-prefix", PREFIX]
    roles = setup.roles
    children: list[Child] = [
        spawn_sim_worker(
            f"{role}-{i}",
            free_port(),
            [
                "--role",
                role,
                "--profile",
                setup.profile,
                "--speed",
                str(setup.speed),
                "--step-target-ms",
                str(step_target_s * 1000),
                *registry,
            ],
            log=STATE_DIR / f"bench-run-{role}-{i}.log",
        )  # fmt: skip
        for i, role in enumerate(roles)
    ]
    try:
        failed = wait_healthy(children)
        if failed is None:
            options = [*registry, "--policy", setup.policy, "--itl-slo-metric", setup.itl_rule]
            if setup.role_plan is not None:
                options += ["--role-plan", role_plan_json(setup.role_plan)]
            children.append(spawn_gateway("gateway", setup.base_port, options, STATE_DIR / "bench-run-gateway.log"))
            failed = wait_healthy(children[-1:], path="/readyz")
        if failed is not None:
            raise RuntimeError(f"{failed.name} did not come up; see {STATE_DIR}/bench-run-*.log")
        yield children[-1].url, redis.url
    finally:
        for child in reversed(children):
            child.stop()
        delete_prefix(redis.url, PREFIX)
        redis.stop()


def run_bench(console: Console, trace: Sequence[TraceSession], label: str, setup: LiveSetup, out: Path | None) -> int:
    """``label`` says where the trace came from (a file, or a workload, rate and seed)."""
    try:
        setup.check()
        profile = load_profile(setup.profile)
    except (OSError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    slo = derived_slo(profile)
    total = sum(len(s.rounds) for s in trace)
    if setup.pool_replicas:  # an elastic pool, starting from its plan's split for the trace's first load
        plan = setup.role_plan
        first = plan.target(opening_load(trace)) if plan else 0
        config = SimConfig(decode=Pool(profile, setup.pool_replicas), prefill=None, slo=slo, policy=setup.policy,
                           itl_rule=setup.itl_rule, initial_prefill=first, role_plan=plan)  # fmt: skip
    else:
        prefill = Pool(profile, setup.prefill_replicas) if setup.prefill_replicas else None
        config = SimConfig(decode=Pool(profile, setup.decode_replicas), prefill=prefill, slo=slo,
                           policy=setup.policy, itl_rule=setup.itl_rule)  # fmt: skip
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with (
            # The engines keep to the step time the simulator gives them (rounds.policies).
            live_stack(setup, step_target(POLICIES[config.policy], slo, config.itl_rule, config.beta)) as (
                url,
                redis_url,
            ),
            Progress(*columns, console=console) as progress,
            RoleWatch(url) as roles,
        ):
            task = progress.add_task(f"{len(trace)} sessions live at {setup.speed:g}x ({setup.policy})", total=total)
            if config.initial_prefill:
                _first_roles(url, redis_url, config.initial_prefill)
            started = time.perf_counter()
            rounds, _ = asyncio.run(
                replay_sessions(url, trace, setup.speed, lambda _: progress.advance(task), tolerate=False)
            )
            wall = time.perf_counter() - started
            lost, duplicated, split, tails = asyncio.run(read_back(url, trace))
            rounds = with_gateway_tails(rounds, tails)
    except (NoRedis, RuntimeError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    with console.status("simulating the same trace"):
        simulated = simulate(config, trace)

    live, sim = live_summary(rounds, slo, setup.speed, setup.itl_rule), sim_summary(simulated)
    points = (live["slo_attainment_rounds"] - sim["slo_attainment_rounds"]) * 100
    rel = live["ttft_p95_s"] / sim["ttft_p95_s"] - 1
    console.print(_table(live, sim, points, rel))
    agrees = abs(points) <= BAR_POINTS and abs(rel) <= BAR_REL
    verdict = "[green]within" if agrees else "[yellow]outside"
    console.print(f"{verdict} the bar ({BAR_POINTS:g} points, {BAR_REL:.0%})")
    result = {
        "profile": setup.profile, "speed": setup.speed, "policy": setup.policy,
        "prefill_replicas": setup.prefill_replicas, "decode_replicas": setup.decode_replicas,
        "trace": label, "sessions": len(trace),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "itl_rule": setup.itl_rule},
        "live": live, "simulated": sim,
        "attainment_points": points, "p95_ttft_rel": rel, "live_wall_s": wall, "within_bar": agrees,
        "rounds_lost": lost, "rounds_duplicated": duplicated, "rounds_split": split,
    }  # fmt: skip
    if setup.pool_replicas:
        result |= {"pool_replicas": setup.pool_replicas, "live_roles": roles.timeline, "live_moves": roles.moves,
                   "simulated_roles": [(r.at, r.prefill) for r in simulated.roles],
                   "simulated_moves": simulated.moves}  # fmt: skip
        console.print(f"roles: {roles.moves} moves live, {simulated.moves} simulated")
    console.print(f"sessions read back: {lost} rounds lost, {duplicated} duplicated, {split} split between engines")
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {out}")
    return 0


class RoleWatch:
    """The gateway's engine roles over the run, read from its /metrics every second:
    (seconds since the start, engines in the prefill role) at each change, and the moves."""

    def __init__(self, url: str) -> None:
        self.url, self.timeline, self.moves = url, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="role-watch", daemon=True)

    def __enter__(self) -> RoleWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        started = time.perf_counter()
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                try:
                    text = client.get(f"{self.url}/metrics").text
                except httpx.HTTPError:
                    text = ""
                prefill = sum(1 for line in text.splitlines()
                              if line.startswith("ampd_worker_role{") and 'role="prefill"' in line)  # fmt: skip
                moves = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("ampd_role_moves_total{")]  # fmt: skip
                self.moves = round(sum(moves)) if moves else self.moves
                if text and (not self.timeline or self.timeline[-1][1] != prefill):
                    self.timeline.append((round(time.perf_counter() - started, 1), prefill))
                self._stop.wait(1.0)


def _first_roles(url: str, redis_url: str, prefill: int) -> None:
    """The pool's first split, as the simulator starts it: ``prefill`` engines to the
    prefill role, once the gateway has applied it."""
    from gateway.elastic_live import set_role
    from surface.registry import heartbeat_client, live_workers

    async def assign() -> None:
        redis = heartbeat_client(redis_url)
        try:
            engines = sorted(i.worker_id for i in await live_workers(redis, PREFIX))
            for worker_id in engines[:prefill]:
                await set_role(redis, PREFIX, worker_id, "prefill")
        finally:
            await redis.aclose()

    asyncio.run(assign())
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/metrics", timeout=5).text.count('role="prefill"') < prefill:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not apply the pool's first split within 10 s")
        time.sleep(0.2)


def _table(live: dict, sim: dict, points: float, rel: float) -> Table:
    table = Table("", "live (x speed)", "simulated", "difference")
    table.add_row("rounds", str(live["rounds"]), str(sim["rounds"]), "")
    table.add_row("SLO attainment", f"{live['slo_attainment_rounds']:.1%}", f"{sim['slo_attainment_rounds']:.1%}",
                  f"{points:+.1f} points")  # fmt: skip
    table.add_row("P95 TTFT", f"{live['ttft_p95_s'] * 1e3:,.0f} ms", f"{sim['ttft_p95_s'] * 1e3:,.0f} ms",
                  f"{rel:+.1%}")  # fmt: skip
    table.add_row("mean TTFT", f"{live['ttft_mean_s'] * 1e3:,.0f} ms", f"{sim['ttft_mean_s'] * 1e3:,.0f} ms", "")
    if live["itl_p95_s"] is not None and sim["itl_p95_s"] is not None:
        table.add_row("P95 ITL", f"{live['itl_p95_s'] * 1e3:,.1f} ms", f"{sim['itl_p95_s'] * 1e3:,.1f} ms", "")
    return table
