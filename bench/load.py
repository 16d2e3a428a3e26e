"""`ampd bench load`: many concurrent agent sessions for minutes, through the gateway.

Each of ``agents`` agents runs sessions back to back until the run's time is up: a
first round, then tool rounds (the model calls a tool, the agent "runs" it for a think
time, answers with a tool message), then a final answer - the loop an agent framework
runs. GPU-free workers (role ``both``) serve at a speed-up. The same load runs twice:
directly against the workers (the agent keeps its session on one worker itself and
sends the whole history each round, which is what the gateway's binding does), then
through the gateway. What is reported, for the gateway run:

* lost or duplicated rounds: after each session the agent reads the session back
  (``GET /v1/sessions/{id}``) and compares the rounds the gateway recorded with the
  rounds it completed; the gateway's ``ampd_requests`` counter must also equal them;
* errors: any non-200 answer, error event, or transport failure, by kind;
* the gateway's memory: resident set size sampled every few seconds, from the moment
  every agent has started to the end;
* the latency the gateway adds: TTFT percentiles through the gateway minus the same
  percentiles called directly. The default policy is ``coloc`` so both runs prefill on
  the session's own worker and the difference is the gateway, not a routing policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx
from rich.console import Console
from rich.table import Table

from ampd.local_redis import delete_prefix, ensure_redis, free_port
from ampd.processes import spawn_gateway, spawn_sim_worker, tree_total, wait_healthy
from bench.gateway import percentile_ms
from bench.overhead import cpu_seconds, runqueue_seconds
from bench.replay import TOOL, agent_client, stream_round, words


@dataclass(frozen=True)
class LoadShape:
    """One agent session: ``rounds`` model calls, all but the last ending in a tool call."""

    rounds: int = 4
    first_prompt_tokens: int = 200
    tool_result_tokens: int = 50
    output_tokens: int = 20
    think_s: tuple[float, float] = (4.0, 12.0)  # the tool's run time, uniform, wall seconds

    def script(self) -> dict:
        call = {"name": "lookup", "arguments": {"q": "x"}}
        rounds = [{"output_tokens": self.output_tokens, "tool_calls": [call]} for _ in range(self.rounds - 1)]
        return {"rounds": [*rounds, {"output_tokens": self.output_tokens}]}


@dataclass
class ArmRecord:
    """What one run saw, appended to by every agent (one event loop: no locks)."""

    ttft_s: list[float] = field(default_factory=list)
    sent_s: list[float] = field(default_factory=list)  # when each of those rounds was sent, from ``started``
    started: float = field(default_factory=time.perf_counter)
    rounds_ok: int = 0
    sessions: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost_rounds: int = 0  # completed by the agent, missing from the gateway's record
    duplicated_rounds: int = 0  # recorded by the gateway more often than the agent sent them
    unverified_sessions: int = 0  # the read-back itself failed


@dataclass(frozen=True)
class ArmResult:
    arm: str
    seconds: float
    sessions: int
    rounds_ok: int
    rounds_per_s: float
    errors: dict[str, int]
    error_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    lost_rounds: int = 0
    duplicated_rounds: int = 0
    unverified_sessions: int = 0
    by_minute: list[dict] = field(default_factory=list)  # rounds sent in each minute, their TTFT p50 / p99
    steady: dict = field(default_factory=dict)  # the rounds sent after the ramp and before the deadline


def by_minute(record: ArmRecord) -> list[dict]:
    """The rounds sent in each minute of the run and their TTFT p50 / p99: whether the
    latency grows with the run's length or is the same from the start."""
    minutes: dict[int, list[float]] = {}
    for sent, ttft in zip(record.sent_s, record.ttft_s, strict=True):
        minutes.setdefault(int(sent // 60), []).append(ttft)
    return [{"minute": m, "rounds": len(v), "ttft_p50_ms": percentile_ms(v, 0.5), "ttft_p99_ms": percentile_ms(v, 0.99)}
            for m, v in sorted(minutes.items())]  # fmt: skip


def at_full_load(record: ArmRecord, ramp_s: float, run_s: float) -> dict:
    """TTFT p50 / p99 of the rounds sent once every agent had started and before the run's
    time was up: the load the arm is named for. The ramp's rounds meet a lightly loaded
    system, and so do those of the sessions that finish after the deadline; a short arm is
    mostly those (a one-minute direct arm with a 30 s ramp), and its percentiles would be
    its easiest minutes set against another arm's hardest."""
    inside = [ttft for sent, ttft in zip(record.sent_s, record.ttft_s, strict=True) if ramp_s <= sent < run_s]
    return {"from_s": ramp_s, "to_s": run_s, "rounds": len(inside),
            "ttft_p50_ms": percentile_ms(inside, 0.5) if inside else None,
            "ttft_p99_ms": percentile_ms(inside, 0.99) if inside else None}  # fmt: skip


def summarise(arm: str, record: ArmRecord, seconds: float, ramp_s: float, run_s: float) -> ArmResult:
    failed = sum(record.errors.values())
    return ArmResult(
        arm, seconds, record.sessions, record.rounds_ok, record.rounds_ok / seconds, dict(record.errors),
        failed / max(1, failed + record.rounds_ok),
        percentile_ms(record.ttft_s, 0.5) if record.ttft_s else float("nan"),
        percentile_ms(record.ttft_s, 0.99) if record.ttft_s else float("nan"),
        record.lost_rounds, record.duplicated_rounds, record.unverified_sessions, by_minute(record),
        at_full_load(record, ramp_s, run_s),
    )  # fmt: skip


def _error_kind(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientError):
        return f"transport: {type(exc).__name__}"
    text = str(exc)
    return text.split(": ", 1)[1][:40] if ": " in text else text[:40]


async def _session(
    client: aiohttp.ClientSession, url: str, model: str, session_id: str, shape: LoadShape, rng: random.Random,
    record: ArmRecord, verify: bool,
) -> None:  # fmt: skip
    seed = zlib.crc32(session_id.encode())
    messages: list[dict] = [{"role": "user", "content": words(seed, 0, shape.first_prompt_tokens)}]
    script, sent = shape.script(), 0
    for k in range(shape.rounds):
        body = {"model": model, "messages": messages, "tools": [TOOL], "stream": True, "sim_script": script}
        sent += 1
        try:
            got = await stream_round(client, url, body, session_id)
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            record.errors[_error_kind(exc)] += 1
            break
        if got.first_token is None:
            record.errors["no tokens"] += 1
            break
        record.ttft_s.append(got.first_token - got.sent)
        record.sent_s.append(got.sent - record.started)
        record.rounds_ok += 1
        messages.append(got.message)
        if k + 1 == shape.rounds:
            break
        await asyncio.sleep(rng.uniform(*shape.think_s))
        result = words(seed, k + 1, shape.tool_result_tokens)
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": result} for c in got.message["tool_calls"]]
    record.sessions += 1
    if verify:
        try:
            async with client.get(f"{url}/v1/sessions/{session_id}", raise_for_status=True) as response:
                recorded = len((await response.json())["rounds"])
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            record.unverified_sessions += 1
            return
        completed = sum(1 for _ in messages if _.get("role") == "assistant")
        record.lost_rounds += max(0, completed - recorded)
        record.duplicated_rounds += max(0, recorded - sent)


async def run_agents(
    route: Callable[[str], str], model: str, agents: int, seconds: float, ramp_s: float, shape: LoadShape,
    verify: bool, seed: int = 0,
) -> tuple[ArmRecord, float]:  # fmt: skip
    """``agents`` closed-loop agents for ``seconds``; ``route`` gives a session's base URL.
    Sessions under way when the time is up finish. Returns the record and the wall time."""
    with _frozen_heap():
        record = ArmRecord()
        started = record.started
        deadline = started + seconds

        async def agent(i: int, client: aiohttp.ClientSession) -> None:
            rng = random.Random(seed * 1_000_003 + i)
            await asyncio.sleep(ramp_s * i / agents)
            n = 0
            while time.perf_counter() < deadline:
                session_id = f"load-{seed}-{i}-{n}-{uuid.uuid4().hex[:6]}"
                await _session(client, route(session_id), model, session_id, shape, rng, record, verify)
                n += 1

        async with agent_client(agents + 16) as client:
            await asyncio.gather(*(agent(i, client) for i in range(agents)))
        return record, time.perf_counter() - started


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """What exists when a run starts (the modules this process imported, the workers' and the
    gateway's handles), kept out of the collector's sight while it lasts: unfrozen, each full
    collection walked it for 50-110 ms, and every round in flight counted that pause in its
    TTFT."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def rss_mib(pid: int) -> float:
    """Resident memory of a process and the processes it started (a gateway of several)."""
    return tree_total(pid, _own_rss_mib)


def _own_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


async def _sample(
    pid: int,
    every_s: float,
    samples: list[tuple[float, float]],
    cpu: list[tuple[float, float, float]],
    stop: asyncio.Event,
) -> None:
    """The gateway's RSS (MiB), and the CPU seconds it has used and waited for so far, every ``every_s``."""
    started = time.perf_counter()
    while not stop.is_set():
        now = time.perf_counter() - started
        samples.append((now, rss_mib(pid)))
        cpu.append((now, cpu_seconds(pid), runqueue_seconds(pid)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def requests_counted(metrics_text: str) -> dict[str, float]:
    """``ampd_requests_total`` by status, from the gateway's /metrics."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("ampd_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            out[status] = float(line.rsplit(" ", 1)[1])
    return out


def run_load_bench(
    console: Console, agents: int, minutes: float, baseline_minutes: float, speed: float, policy: str,
    shape: LoadShape, out: Path | None, gateway_processes: int = 1,
) -> int:  # fmt: skip
    prefix = f"load-{uuid.uuid4().hex[:8]}"
    state = Path(".ampd") / prefix
    state.mkdir(parents=True, exist_ok=True)
    redis_handle = ensure_redis(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"), state / "redis")
    common = ["--redis-url", redis_handle.url, "--redis-prefix", prefix]
    workers = [
        spawn_sim_worker(f"worker{i}", port, ["--role", "both", "--speed", str(speed), "--max-num-seqs", "1024",
                                              *common], log=state / f"worker{i}.log")
        for i, port in enumerate((free_port(), free_port()))
    ]  # fmt: skip
    options = [*common, "--policy", policy, "--prefill-slots", "64", "--max-queue", str(agents * 2),
               "--processes", str(gateway_processes)]  # fmt: skip
    gateway = spawn_gateway("gateway", free_port(), options, log=state / "gateway.log")
    ramp_s = min(30.0, minutes * 60 / 4)
    samples: list[tuple[float, float]] = []
    cpu: list[tuple[float, float, float]] = []
    try:
        if wait_healthy(workers) or wait_healthy([gateway], path="/readyz"):
            raise RuntimeError(f"a worker or the gateway did not start; logs in {state}")
        model = httpx.get(f"{workers[0].url}/v1/models").json()["data"][0]["id"]

        def by_hash(session_id: str) -> str:
            return workers[zlib.crc32(session_id.encode()) % len(workers)].url

        console.print(f"direct: {agents} agents for {baseline_minutes:g} min ...")
        direct, direct_s = asyncio.run(run_agents(by_hash, model, agents, baseline_minutes * 60, ramp_s, shape,
                                                  verify=False, seed=1))  # fmt: skip
        console.print(f"gateway ({policy}): {agents} agents for {minutes:g} min ...")

        async def through_gateway() -> tuple[ArmRecord, float]:
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample(gateway.process.pid, 5.0, samples, cpu, stop))
            try:
                return await run_agents(lambda _: gateway.url, model, agents, minutes * 60, ramp_s, shape,
                                        verify=True, seed=2)  # fmt: skip
            finally:
                stop.set()
                await sampler

        via, via_s = asyncio.run(through_gateway())
        counted = requests_counted(httpx.get(f"{gateway.url}/metrics").text)
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
        delete_prefix(redis_handle.url, prefix)
        redis_handle.stop()

    arms = [summarise("direct", direct, direct_s, ramp_s, baseline_minutes * 60),
            summarise("gateway", via, via_s, ramp_s, minutes * 60)]  # fmt: skip
    for minute in arms[1].by_minute:  # the gateway's CPU per round, and its wait for one, minute by minute
        inside = [(c, w) for t, c, w in cpu if minute["minute"] * 60 <= t <= (minute["minute"] + 1) * 60]
        for key, i in (("cpu_ms_per_round", 0), ("cpu_wait_ms_per_round", 1)):
            minute[key] = (inside[-1][i] - inside[0][i]) * 1000 / minute["rounds"] if len(inside) > 1 else None
    steady = [mib for t, mib in samples if t >= ramp_s]
    report = {
        "agents": agents, "minutes": minutes, "baseline_minutes": baseline_minutes, "speed": speed,
        "policy": policy, "shape": asdict(shape), "cpus": os.cpu_count(), "gateway_processes": gateway_processes,
        "arms": [asdict(a) for a in arms],
        "added_ttft_p50_ms": arms[1].ttft_p50_ms - arms[0].ttft_p50_ms,
        "added_ttft_p99_ms": arms[1].ttft_p99_ms - arms[0].ttft_p99_ms,
        "steady_ttft_p99_ratio": _ratio(arms[1].steady["ttft_p99_ms"], arms[0].steady["ttft_p99_ms"]),
        "gateway_rss_mib": {"start": steady[0] if steady else None, "end": steady[-1] if steady else None,
                            "max": max(steady) if steady else None},
        "gateway_requests_counted": counted, "rss_samples": samples,
    }  # fmt: skip
    print_report(console, report, arms)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    clean = (via.lost_rounds == via.duplicated_rounds == via.unverified_sessions == 0 and not via.errors
             and counted.get("200", 0) == via.rounds_ok)  # fmt: skip
    return 0 if clean else 1


def print_report(console: Console, report: dict, arms: Sequence[ArmResult]) -> None:
    table = Table("arm", "min", "sessions", "rounds", "rounds/s", "errors", "TTFT p50 / p99", "lost / dup")
    for a in arms:
        table.add_row(a.arm, f"{a.seconds / 60:.1f}", str(a.sessions), str(a.rounds_ok), f"{a.rounds_per_s:.1f}",
                      f"{sum(a.errors.values())} ({a.error_rate:.2%})", f"{a.ttft_p50_ms:.1f} / {a.ttft_p99_ms:.1f} ms",
                      f"{a.lost_rounds} / {a.duplicated_rounds}" if a.arm == "gateway" else "-")  # fmt: skip
    console.print(table)
    rss = report["gateway_rss_mib"]
    added = f"p50 {report['added_ttft_p50_ms']:+.1f} ms, p99 {report['added_ttft_p99_ms']:+.1f} ms"
    console.print(f"gateway adds TTFT {added}; "
                  f"RSS start {rss['start']:.0f} MiB, end {rss['end']:.0f} MiB, max {rss['max']:.0f} MiB; "
                  f"ampd_requests_total {report['gateway_requests_counted']}")  # fmt: skip
    d, g = (a.steady for a in arms)
    if d["rounds"] and g["rounds"]:
        console.print(f"at full load (rounds sent after the {d['from_s']:.0f} s ramp, before the deadline): "
                      f"direct {d['ttft_p50_ms']:.1f} / {d['ttft_p99_ms']:.1f} ms ({d['rounds']} rounds), "
                      f"gateway {g['ttft_p50_ms']:.1f} / {g['ttft_p99_ms']:.1f} ms ({g['rounds']} rounds); "
                      f"p99 {report['steady_ttft_p99_ratio']:.2f}x direct's")  # fmt: skip
    for a in arms:
        for kind, n in a.errors.items():
            console.print(f"  {a.arm} error x{n}: {kind}")
    minutes = Table("minute", "rounds", "TTFT p50 / p99", "CPU per round", "waiting for a CPU per round",
                    title="Through the gateway, by minute")  # fmt: skip
    for m in arms[1].by_minute:
        cpu, wait = (_ms(m.get(k)) for k in ("cpu_ms_per_round", "cpu_wait_ms_per_round"))
        minutes.add_row(
            str(m["minute"]), str(m["rounds"]), f"{m['ttft_p50_ms']:.1f} / {m['ttft_p99_ms']:.1f} ms", cpu, wait
        )
    console.print(minutes)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"
