"""`ampd bench gateway`: the latency the gateway adds, and what a routing decision costs.

One GPU-free worker (role both, so every prefill is local and the only difference is
the gateway) is driven at 1, 64 and 256 concurrent streams, each stream sending
requests one after another, first directly and then through the gateway. Reported:
TTFT and end-to-end latency percentiles both ways and their differences. The gateway
runs with enough prefill slots not to queue (queueing is a policy, not overhead).
The routing decision is also timed on its own: AMPD's Alg. 1 in its most expensive
branch (every Eq. 2 evaluated) over one decode and eight prefill workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from ampd.local_redis import delete_prefix, ensure_redis, free_port
from ampd.processes import spawn_gateway, spawn_sim_worker, wait_healthy
from bench.loadgen import StreamTiming, stream_chat
from perfmodel.profile import load_profile
from perfmodel.slo import SLO
from rounds.core import ITL, TTFT_REMOTE, Candidate, RoundCore, SessionState, Signals
from rounds.policies import POLICIES


@dataclass
class Level:
    streams: int
    direct_ttft_p50_ms: float
    direct_ttft_p99_ms: float
    gateway_ttft_p50_ms: float
    gateway_ttft_p99_ms: float
    direct_e2e_p50_ms: float
    gateway_e2e_p50_ms: float

    @property
    def added_p50_ms(self) -> float:
        return self.gateway_ttft_p50_ms - self.direct_ttft_p50_ms

    @property
    def added_p99_ms(self) -> float:
        return self.gateway_ttft_p99_ms - self.direct_ttft_p99_ms


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def agent_history(tool_rounds: int) -> list[dict[str, object]]:
    """An agent's task and its ``tool_rounds`` tool calls with their results (two messages
    each, ~120 words per result); none for no tool rounds."""
    if tool_rounds == 0:
        return []
    rng = random.Random(0)
    words = ["search", "result", "city", "weather", "page", "found", "the", "of", "and", "in", "to", "for", "data"]
    out: list[dict[str, object]] = [{"role": "user", "content": "Find this week's weather in every city listed."}]
    for n in range(tool_rounds):
        arguments = json.dumps({"query": " ".join(rng.choices(words, k=6))})
        call = {"id": f"call_{n}", "type": "function", "function": {"name": "search", "arguments": arguments}}
        result = " ".join(rng.choices(words, k=120))
        out += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": result},
        ]
    return out


async def drive(
    url: str, model: str, streams: int, requests: int, output_tokens: int, tool_rounds: int = 0
) -> list[StreamTiming]:
    """``streams`` closed loops of ``requests`` streamed chat completions each. Every request
    opens a session of its own: a message of its own after the same agent history of
    ``tool_rounds`` tool rounds (``agent_history``), so that, as in a session's later
    round, all it carries but its last message has been seen before - by the gateway and
    by the engine's prefix cache."""
    history = agent_history(tool_rounds)

    async def one_stream(i: int) -> list[StreamTiming]:
        out = []
        for k in range(requests):
            last = {"role": "user", "content": f"bench {uuid.uuid4().hex} {i} {k}"}
            body = {"model": model, "messages": [*history, last], "max_tokens": output_tokens, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            out.append(await stream_chat(url, json.dumps(body).encode()))
        return out

    nested = await asyncio.gather(*(one_stream(i) for i in range(streams)))
    return [t for stream in nested for t in stream]


def decision_cost_us(iterations: int = 20_000) -> float:
    """Microseconds per round the core plans (AMPD's routing in its full-cost branch and the
    queue estimate), as the gateway times it; no I/O."""
    d_prof, p_prof = load_profile("llama-3.1-70b_h20_tp4"), load_profile("llama-3.1-70b_h20_tp2")
    decode, prefills = Candidate("d", d_prof), [Candidate(f"p{i}", p_prof) for i in range(8)]
    costs = {"d": 0.4} | {p.worker_id: 0.1 * i for i, p in enumerate(prefills)}
    signals = Signals(costs, {(ITL, "d"): 1.0} | {(TTFT_REMOTE, p.worker_id): 9.0 for p in prefills})
    state, slo = SessionState("d", l_hist=3000), SLO(1.0, 0.05)
    core = RoundCore(POLICIES["ampd"], rng=random.Random(0))
    started = time.perf_counter()
    for _ in range(iterations):
        core.plan(state, "t", 3400, 0.0, decode, prefills, signals, slo)
    return (time.perf_counter() - started) / iterations * 1e6


def run_gateway_bench(
    console: Console, speed: float, levels: list[int], requests: int, output_tokens: int, out: Path | None
) -> int:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    state = Path(".ampd") / prefix
    state.mkdir(parents=True, exist_ok=True)
    redis_handle = ensure_redis(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"), state / "redis")
    worker_port, gateway_port = free_port(), free_port()
    worker = spawn_sim_worker(
        "worker",
        worker_port,
        ["--role", "both", "--speed", str(speed), "--max-num-seqs", "1024",
         "--redis-url", redis_handle.url, "--redis-prefix", prefix],
        log=state / "worker.log",
        cpu=0,
    )  # fmt: skip
    gateway_options = ["--redis-url", redis_handle.url, "--redis-prefix", prefix, "--prefill-slots", "4096"]
    gateway = spawn_gateway("gateway", gateway_port, gateway_options, log=state / "gateway.log")
    results: list[Level] = []
    try:
        if wait_healthy([worker]) or wait_healthy([gateway], path="/readyz"):
            raise RuntimeError("worker or gateway did not start")
        if (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {1})
        model = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"]
        asyncio.run(drive(gateway.url, model, 4, 2, 4))  # warm both paths
        asyncio.run(drive(worker.url, model, 4, 2, 4))
        for streams in levels:
            console.print(f"{streams} concurrent streams ...")
            direct = asyncio.run(drive(worker.url, model, streams, requests, output_tokens))
            via = asyncio.run(drive(gateway.url, model, streams, requests, output_tokens))
            results.append(Level(
                streams,
                percentile_ms([t.ttft for t in direct], 0.5), percentile_ms([t.ttft for t in direct], 0.99),
                percentile_ms([t.ttft for t in via], 0.5), percentile_ms([t.ttft for t in via], 0.99),
                percentile_ms([t.last_event - t.sent for t in direct], 0.5),
                percentile_ms([t.last_event - t.sent for t in via], 0.5),
            ))  # fmt: skip
        observed = httpx.get(f"{gateway.url}/metrics").text
    finally:
        gateway.stop()
        worker.stop()
        delete_prefix(redis_handle.url, prefix)
        redis_handle.stop()

    sums = {line.split(" ")[0]: float(line.split(" ")[1]) for line in observed.splitlines()
            if line.startswith("ampd_routing_decision_seconds_")}  # fmt: skip
    live_us = sums["ampd_routing_decision_seconds_sum"] / max(sums["ampd_routing_decision_seconds_count"], 1) * 1e6
    isolated_us = decision_cost_us()

    table = Table(
        "streams", "direct TTFT p50/p99", "gateway TTFT p50/p99", "added p50", "added p99", "e2e p50 direct/gw"
    )
    for x in results:
        table.add_row(str(x.streams), f"{x.direct_ttft_p50_ms:.2f} / {x.direct_ttft_p99_ms:.2f} ms",
                      f"{x.gateway_ttft_p50_ms:.2f} / {x.gateway_ttft_p99_ms:.2f} ms",
                      f"{x.added_p50_ms:+.2f} ms", f"{x.added_p99_ms:+.2f} ms",
                      f"{x.direct_e2e_p50_ms:.1f} / {x.gateway_e2e_p50_ms:.1f} ms")  # fmt: skip
    console.print(table)
    console.print(f"routing decision: {isolated_us:.1f} us isolated (Alg. 1 full-cost branch, 1+8 workers); "
                  f"{live_us:.1f} us mean in the gateway during the run")  # fmt: skip
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "speed": speed, "requests_per_stream": requests, "output_tokens": output_tokens,
            "levels": [asdict(x) | {"added_p50_ms": x.added_p50_ms, "added_p99_ms": x.added_p99_ms} for x in results],
            "decision_us_isolated": isolated_us, "decision_us_live_mean": live_us,
        }, indent=2) + "\n")  # fmt: skip
    return 0
