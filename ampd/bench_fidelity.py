"""`ampd bench fidelity`: the same trace live and in the simulator, side by side.

Live: the gateway and GPU-free workers running ``speed`` times faster than the modelled
GPU, driven by ampd.replay; wall-clock latencies are multiplied by ``speed`` to compare
with the simulator's virtual time. The issue's bar: SLO attainment within 5 points and
P95 TTFT within 10%.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ampd.local_redis import NoRedis, ensure_redis
from ampd.processes import Child, spawn_gateway, spawn_sim_worker, wait_healthy
from ampd.replay import LiveRound, replay
from ampd.stack import STATE_DIR
from planner.profile import load_profile
from planner.simulator import Pool, SimConfig, SimReport, simulate
from planner.slo import SLO, derived_slo
from planner.trace import WORKLOADS, generate

PREFIX = "ampd-fidelity"


def _live_summary(rounds: list[LiveRound], slo: SLO, speed: float) -> dict:
    """Wall-clock rounds in modelled seconds, judged against the modelled SLO."""
    ttft = np.array([r.ttft_s * speed for r in rounds])
    itl = [r.mean_itl_s * speed for r in rounds if r.mean_itl_s is not None]
    met = [
        r.ttft_s * speed <= slo.ttft_s and (r.mean_itl_s is None or r.mean_itl_s * speed <= slo.itl_s) for r in rounds
    ]
    return {
        "rounds": len(rounds),
        "slo_attainment_rounds": sum(met) / len(met),
        "ttft_p95_s": float(np.percentile(ttft, 95)),
        "ttft_mean_s": float(ttft.mean()),
        "itl_p95_s": float(np.percentile(itl, 95)) if itl else None,
    }


def _sim_summary(report: SimReport) -> dict:
    return {
        "rounds": report.rounds,
        "slo_attainment_rounds": report.slo_attainment_rounds,
        "ttft_p95_s": report.ttft.p95_s,
        "ttft_mean_s": report.ttft.mean_s,
        "itl_p95_s": report.itl.p95_s,
        "local_share_incremental": report.local_share_incremental,
    }


def run_fidelity_bench(
    console: Console,
    redis_url: str,
    profile_name: str,
    speed: float,
    prefill_replicas: int,
    decode_replicas: int,
    sessions: int,
    rate: float,
    policy: str,
    seed: int,
    base_port: int,
    out: Path | None,
) -> int:
    profile = load_profile(profile_name)
    slo = derived_slo(profile)
    trace = generate(WORKLOADS["toolbench"], sessions, rate, seed)
    prefill = Pool(profile, prefill_replicas) if prefill_replicas else None
    config = SimConfig(decode=Pool(profile, decode_replicas), prefill=prefill, slo=slo, policy=policy, seed=seed)
    simulated = simulate(config, trace)

    STATE_DIR.mkdir(exist_ok=True)
    try:
        redis = ensure_redis(redis_url, STATE_DIR / "redis-fidelity")
    except NoRedis as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    registry = ["--redis-url", redis.url, "--redis-prefix", PREFIX]
    roles = ["prefill"] * prefill_replicas + ["decode"] * decode_replicas
    workers: list[Child] = [
        spawn_sim_worker(
            f"{role}-{i}",
            base_port + 1 + i,
            ["--role", role, "--profile", profile_name, "--speed", str(speed), *registry],
            log=STATE_DIR / f"fidelity-{role}-{i}.log",
        )  # fmt: skip
        for i, role in enumerate(roles)
    ]
    children = list(workers)
    try:
        failed = wait_healthy(workers)
        if failed is None:
            gateway = spawn_gateway("gateway", base_port, [*registry, "--policy", policy],
                                    STATE_DIR / "fidelity-gateway.log")  # fmt: skip
            children.append(gateway)
            failed = wait_healthy([gateway], path="/readyz")
        if failed is not None:
            console.print(f"[red]{failed.name} did not come up; see {STATE_DIR}/fidelity-*.log[/red]")
            return 1
        with console.status(f"replaying {sessions} sessions live at {speed}x"):
            started = time.perf_counter()
            rounds = asyncio.run(replay(gateway.url, trace, speed))
            wall = time.perf_counter() - started
    finally:
        for child in reversed(children):
            child.stop()
        _flush(redis.url)
        redis.stop()

    live, sim = _live_summary(rounds, slo, speed), _sim_summary(simulated)
    table = Table("", "live (x speed)", "simulated", "difference")
    table.add_row("rounds", str(live["rounds"]), str(sim["rounds"]), "")
    points = (live["slo_attainment_rounds"] - sim["slo_attainment_rounds"]) * 100
    table.add_row("SLO attainment", f"{live['slo_attainment_rounds']:.1%}", f"{sim['slo_attainment_rounds']:.1%}",
                  f"{points:+.1f} points")  # fmt: skip
    rel = live["ttft_p95_s"] / sim["ttft_p95_s"] - 1
    table.add_row(
        "P95 TTFT", f"{live['ttft_p95_s'] * 1e3:,.0f} ms", f"{sim['ttft_p95_s'] * 1e3:,.0f} ms", f"{rel:+.1%}"
    )
    table.add_row("mean TTFT", f"{live['ttft_mean_s'] * 1e3:,.0f} ms", f"{sim['ttft_mean_s'] * 1e3:,.0f} ms", "")
    if live["itl_p95_s"] is not None and sim["itl_p95_s"] is not None:
        table.add_row("P95 ITL", f"{live['itl_p95_s'] * 1e3:,.1f} ms", f"{sim['itl_p95_s'] * 1e3:,.1f} ms", "")
    console.print(table)
    ok = abs(points) <= 5 and abs(rel) <= 0.10
    console.print(("[green]within" if ok else "[yellow]outside") + " the bar (5 points, 10%)")
    result = {
        "profile": profile_name, "speed": speed, "policy": policy, "prefill_replicas": prefill_replicas,
        "decode_replicas": decode_replicas, "sessions": sessions, "rate": rate, "seed": seed,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}, "live": live, "simulated": sim,
        "attainment_points": points, "p95_ttft_rel": rel, "live_wall_s": wall, "within_bar": ok,
    }  # fmt: skip
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {out}")
    return 0


def _flush(redis_url: str) -> None:
    """Drop what the run left under its prefix."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{PREFIX}:*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])
