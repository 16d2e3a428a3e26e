"""`ampd bench overhead`: the latency a gateway adds, against peer gateways.

One GPU-free worker (role ``both``, pinned to one core) is called five ways, in one run:
(a) directly, (b) through the ampd gateway (``ampd``: one process; ``ampd-xN``: N
processes sharing its port, ``ampd gateway --processes N``), (c) through LiteLLM's proxy,
(d) through the ``vllm-router`` package (the vLLM project's Rust router), (e) through
``relay`` (bench.relay: ampd's server and engine connections relaying bytes and doing
nothing else - the floor of a gateway on ampd's Python stack). Each peer is installed from
PyPI into its own venv under bench/venvs/ at run time (never vendored), pinned below.
At each level of concurrent streams - each stream sending streamed chat completions one
after another - the arms run one after the other, so a level's numbers share the
machine's state. Reported per arm: TTFT p50/p99, the latency added over the direct call
(p50, p99), the request rate reached (completed requests / wall seconds: the most a
closed loop of that many streams gets through) and, for a proxy, its CPU per request
(user + system time of its process and the processes it started, from /proc, over the
level's run, divided by the requests completed: what one round costs the proxy). Ratios are each peer's over
ampd's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from ampd.local_redis import delete_prefix, ensure_redis, free_port
from ampd.processes import Child, spawn_gateway, spawn_sim_worker, tree_total, wait_healthy
from bench.gateway import drive, percentile_ms
from bench.peer_venvs import REQUIREMENTS, ensure_venv
from bench.relay import relay_argv

ARMS = ("direct", "ampd", "relay", "litellm", "vllm-router")
GATEWAY_ARM = re.compile(r"ampd(?:-x([1-9][0-9]*))?")  # ampd, or ampd-xN: N gateway processes


# -- the peers: how each is installed and started (pure) -----------------------------------
def litellm_config(model: str, upstream: str) -> str:
    """One model routed to an OpenAI-compatible upstream; LiteLLM's own extras switched off
    (no database, no spend logs, no telemetry, no callbacks), so that what is measured is
    the proxying."""
    return json.dumps(
        {
            "model_list": [
                {
                    "model_name": model,
                    "litellm_params": {
                        "model": f"hosted_vllm/{model}",
                        "api_base": f"{upstream}/v1",
                        "api_key": "none",
                    },
                }
            ],
            "litellm_settings": {
                "telemetry": False,
                "drop_params": True,
                "callbacks": [],
                "turn_off_message_logging": True,
            },
            "general_settings": {"disable_spend_logs": True, "disable_reset_budget": True},
        },  # fmt: skip
        indent=2,
    )


def peer_argv(peer: str, venv: Path, port: int, upstream: str, config: Path) -> list[str]:
    if peer == "litellm":
        return [str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                "--num_workers", "1"]  # fmt: skip
    if peer == "vllm-router":
        return [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                upstream, "--policy", "round_robin", "--log-level", "warning"]  # fmt: skip
    raise ValueError(f"unknown peer {peer!r}")


# LiteLLM refuses to start without a master key; the other arms take no key either, and
# checking one would be a cost the others do not pay. It also fetches a Llama tokenizer
# from the Hugging Face hub to count tokens, retrying for 23 s per request where there
# is no network; offline, it counts with its bundled tokenizer instead. Its model price
# map is the bundled one for the same reason.
PEER_ENV = {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "DISABLE_SCHEMA_UPDATE": "True",
            "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true", "HF_HUB_OFFLINE": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # fmt: skip
HEALTH = {"ampd": "/readyz", "litellm": "/health/liveliness", "vllm-router": "/health", "relay": "/health"}


# -- results (pure) --------------------------------------------------------------------------
@dataclass(frozen=True)
class ArmLevel:
    arm: str
    streams: int
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    request_rate: float  # completed requests per wall second
    events_per_request: float  # SSE data events: equal across arms when each proxies every token
    cpu_ms_per_request: float | None = None  # the proxy's CPU (user + system) per completed request


@dataclass(frozen=True)
class Overhead:
    arm: str
    streams: int
    added_p50_ms: float
    added_p99_ms: float
    request_rate: float
    added_p50_vs_ampd: float | None  # peer's added latency over ampd's; None where ampd adds none
    added_p99_vs_ampd: float | None
    rate_vs_ampd: float | None


def _ratio(x: float, over: float) -> float | None:
    return x / over if over > 0 else None


def overheads(levels: Sequence[ArmLevel]) -> list[Overhead]:
    """Each proxied arm against the direct call at the same concurrency, and against ampd."""
    at = {(x.arm, x.streams): x for x in levels}
    out = []
    for x in levels:
        direct, ampd = at.get(("direct", x.streams)), at.get(("ampd", x.streams))
        if x.arm == "direct" or direct is None:
            continue
        p50, p99 = x.ttft_p50_ms - direct.ttft_p50_ms, x.ttft_p99_ms - direct.ttft_p99_ms
        ratios: tuple[float | None, float | None, float | None] = (None, None, None)
        if ampd is not None:
            ratios = (
                _ratio(p50, ampd.ttft_p50_ms - direct.ttft_p50_ms),
                _ratio(p99, ampd.ttft_p99_ms - direct.ttft_p99_ms),
                _ratio(x.request_rate, ampd.request_rate),
            )
        out.append(Overhead(x.arm, x.streams, p50, p99, x.request_rate, *ratios))
    return out


def markdown(levels: Sequence[ArmLevel], rows: Sequence[Overhead], failures: dict[str, str]) -> str:
    def ratio(r: float | None) -> str:
        return "-" if r is None else f"{r:.2f}x"

    lines = ["| streams | arm | TTFT p50 / p99 | added p50 / p99 | requests/s | CPU/request "
             "| added p50, p99, rate vs ampd |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    added = {(r.arm, r.streams): r for r in rows}
    for x in levels:
        r = added.get((x.arm, x.streams))
        extra = "-" if r is None else f"{r.added_p50_ms:+.1f} / {r.added_p99_ms:+.1f} ms"
        vs = "-" if r is None or x.arm == "ampd" else (
            f"{ratio(r.added_p50_vs_ampd)}, {ratio(r.added_p99_vs_ampd)}, {ratio(r.rate_vs_ampd)}")  # fmt: skip
        cpu = "-" if x.cpu_ms_per_request is None else f"{x.cpu_ms_per_request:.2f} ms"
        lines.append(f"| {x.streams} | {x.arm} | {x.ttft_p50_ms:.1f} / {x.ttft_p99_ms:.1f} ms | {extra} | "
                     f"{x.request_rate:.0f} | {cpu} | {vs} |")  # fmt: skip
    lines += [f"\n{arm} could not be run: {why}" for arm, why in failures.items()]
    return "\n".join(lines) + "\n"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process and the processes it started (a gateway of
    several processes) have used, all their threads included."""
    return tree_total(pid, _own_cpu_seconds)


def runqueue_seconds(pid: int) -> float:
    """Seconds the threads of a process and of those it started have spent ready to run
    but waiting for a CPU: on a machine the gateway shares with its engines, its clients
    and Redis, the part of its latency that is the machine's, not its own work."""
    return tree_total(pid, _own_runqueue_seconds)


def _own_cpu_seconds(pid: int) -> float:
    """The time a process's threads have run on a CPU, to the nanosecond: the first field
    of each ``/proc/<pid>/task/<tid>/schedstat``. The user and system times of
    ``/proc/<pid>/stat`` come in clock ticks (10 ms here), which a gateway spending ~1 ms
    a request crosses only every ten requests. A thread that has ended no longer counts."""
    return _schedstat(pid, 0)


def _own_runqueue_seconds(pid: int) -> float:
    """The time a process's threads have waited on a run queue: schedstat's second field."""
    return _schedstat(pid, 1)


def _schedstat(pid: int, field: int) -> float:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[field])
    return total / 1e9


def measure(
    arm: str,
    url: str,
    model: str,
    streams: int,
    requests: int,
    output_tokens: int,
    tool_rounds: int,
    pid: int | None = None,
) -> ArmLevel:
    """One arm at one level; ``pid``: the proxy's process, whose CPU per request is reported."""
    cpu = cpu_seconds(pid) if pid is not None else None
    started = time.perf_counter()
    timings = asyncio.run(drive(url, model, streams, requests, output_tokens, tool_rounds))
    wall = time.perf_counter() - started
    used = None if pid is None or cpu is None else (cpu_seconds(pid) - cpu) * 1000 / max(1, len(timings))
    return ArmLevel(
        arm, streams, len(timings), percentile_ms([t.ttft for t in timings], 0.5),
        percentile_ms([t.ttft for t in timings], 0.99), percentile_ms([t.last_event - t.sent for t in timings], 0.5),
        len(timings) / wall, sum(t.events for t in timings) / len(timings), used,
    )  # fmt: skip


# -- the run ---------------------------------------------------------------------------------
def _start_peer(peer: str, upstream: str, model: str, state: Path) -> Child:
    port = free_port()
    if peer == "relay":  # this package's own, in this interpreter
        argv = relay_argv(port, upstream)
    else:
        config = state / f"{peer}.json"
        config.write_text(litellm_config(model, upstream))
        argv = peer_argv(peer, ensure_venv(peer), port, upstream, config)
    log = (state / f"{peer}.log").open("ab")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **PEER_ENV})
    child = Child(peer, f"http://127.0.0.1:{port}", process)
    if wait_healthy([child], timeout_s=120, path=HEALTH[peer]) is not None:
        child.stop()
        tail = (state / f"{peer}.log").read_text(errors="replace")[-600:]
        raise RuntimeError(f"{peer} did not answer {HEALTH[peer]} within 120 s: {tail}")
    return child


def run_overhead_bench(
    console: Console,
    arms: Sequence[str],
    levels: Sequence[int],
    requests: int,
    output_tokens: int,
    tool_rounds: int,
    out: Path | None,
) -> int:
    unknown = [a for a in arms if a not in ARMS and not GATEWAY_ARM.fullmatch(a)]
    if unknown:
        console.print(f"[red]unknown arms {unknown}; known: {', '.join(ARMS)}, ampd-xN[/red]")
        return 2
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    state = Path(".ampd") / prefix
    state.mkdir(parents=True, exist_ok=True)
    redis_handle = ensure_redis(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"), state / "redis")
    registry = ["--redis-url", redis_handle.url, "--redis-prefix", prefix]
    worker_port = free_port()
    worker = spawn_sim_worker("worker", worker_port, ["--role", "both", "--max-num-seqs", "1024", *registry],
                              log=state / "worker.log", cpu=0)  # fmt: skip
    children, urls, failures = [worker], {"direct": worker.url}, {}
    pids: dict[str, int] = {}  # each proxy's process, for its CPU per request
    load = os.getloadavg()
    try:
        if wait_healthy([worker]):
            raise RuntimeError("the GPU-free worker did not start")
        model = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"]
        for arm in arms:
            shape = GATEWAY_ARM.fullmatch(arm)
            if shape is None:
                continue
            options = [*registry, "--prefill-slots", "4096", "--processes", shape.group(1) or "1"]
            gateway = spawn_gateway(arm, free_port(), options, state / f"{arm}.log")
            children.append(gateway)
            if wait_healthy([gateway], path="/readyz"):
                raise RuntimeError(f"the {arm} gateway did not start")
            urls[arm], pids[arm] = gateway.url, gateway.process.pid
        for peer in (a for a in arms if a in ("relay", "litellm", "vllm-router")):
            with console.status(f"installing and starting {peer}"):
                try:
                    children.append(_start_peer(peer, worker.url, model, state))
                    urls[peer], pids[peer] = children[-1].url, children[-1].process.pid
                except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                    failures[peer] = str(exc)
                    console.print(f"[yellow]{peer}: {exc}[/yellow]")
        if (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {1})  # the load generator off the worker's core
        running = [a for a in arms if a in urls]
        for arm in running:  # warm every path
            asyncio.run(drive(urls[arm], model, 4, 2, 4))
        results = []
        for streams in levels:
            for arm in running:
                console.print(f"{streams} streams through {arm} ...")
                try:
                    results.append(
                        measure(arm, urls[arm], model, streams, requests, output_tokens, tool_rounds, pids.get(arm))
                    )
                except (RuntimeError, OSError) as exc:  # a peer that fails a request: its level has no result
                    failures.setdefault(arm, f"a request failed at {streams} streams: {exc}")
                    console.print(f"[yellow]{arm} failed at {streams} streams: {exc}[/yellow]")
    finally:
        for child in reversed(children):
            child.stop()
        delete_prefix(redis_handle.url, prefix)
        redis_handle.stop()

    rows = overheads(results)
    columns = ("streams", "arm", "TTFT p50/p99", "added p50/p99", "req/s", "CPU/req", "vs ampd: added p50, p99, rate")
    table = Table(*columns)
    for line in markdown(results, rows, {}).splitlines()[2:]:
        table.add_row(*[cell.strip() for cell in line.strip("|").split("|")])
    console.print(table)
    for arm, why in failures.items():
        console.print(f"[yellow]{arm} could not be run: {why}[/yellow]")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "requests_per_stream": requests, "output_tokens": output_tokens, "tool_rounds": tool_rounds,
            "requirements": {peer: REQUIREMENTS[peer] for peer in ("litellm", "vllm-router")},
            "load_average_before": load, "load_average_after": os.getloadavg(),
            "levels": [asdict(x) for x in results], "overheads": [asdict(x) for x in rows], "failures": failures,
        }  # fmt: skip
        out.write_text(json.dumps(data, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(results, rows, failures))
        console.print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
