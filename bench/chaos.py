"""`ampd bench chaos`: agent sessions while the system's parts are killed for real.

A private Redis, a prefill and two decode GPU-free workers, an rq tools worker and two
gateway replicas. Agents run sessions back to back: streamed rounds with seeded
replies; a client tool call between rounds; one session in four also lets the gateway
run a server-side ``python`` tool. Each round goes to one replica, alternating, as a
load balancer would send it; a connection the replica refuses or breaks is retried
once on the other replica (what a load balancer or an SDK does).

Every ``interval_s`` one part is SIGKILLed and restarted ``down_s`` later on its port:
a decode worker, the prefill worker, Redis (which comes back empty), the tools worker
or a gateway replica, in turn. With ``sentinel`` Redis is run as operators run it - a
primary, a replica and three sentinels (ampd.local_redis.SentinelRedis) - and its fault
kills the primary: once the sentinels have promoted the replica, the old primary comes
back and joins as a replica, and no session's record may be lost. Checked for every
round and session:

* the stream is one unbroken completion: one id, one role delta, one finish reason,
  ``[DONE]``, no error event;
* a round whose stream moved to another decode worker (its record says
  ``migrations`` > 0) has exactly the text an undisturbed engine gives for the same
  request and seed: no token lost or repeated;
* the rounds the gateway recorded for the session equal the rounds the agent
  completed (sessions whose records an empty Redis lost are counted apart).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from ampd.local_redis import (
    LocalRedis,
    SentinelRedis,
    free_port,
    server_binary,
    start_private_redis,
    start_sentinel_redis,
)
from ampd.processes import Child, spawn_gateway, spawn_sim_worker, spawn_tools_worker, tools_worker_ready, wait_healthy
from bench.replay import TOOL, words
from gateway.engines.upstream import Reply

FAULTS = ("decode", "prefill", "redis", "tools", "gateway")
PREFIX = "chaos"


@dataclass
class Tally:
    rounds_ok: int = 0
    retried: int = 0  # rounds that needed the other replica
    failed: dict[str, int] = field(default_factory=dict)  # rounds not completed even on the other replica, by why
    failures: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds into the run, why, session)
    migrated_rounds: int = 0
    migrated_checked: int = 0
    text_mismatches: int = 0
    sessions: int = 0
    sessions_verified: int = 0
    sessions_lost_to_redis: int = 0
    lost_rounds: int = 0
    duplicated_rounds: int = 0
    faults: list[tuple[float, str]] = field(default_factory=list)  # (seconds into the run, part)
    mismatched_sessions: list[dict] = field(default_factory=list)  # the first few, for a look at why


@dataclass(frozen=True)
class Streamed:
    status: int
    chunks: list[dict]
    done: bool

    @property
    def text(self) -> str:
        return "".join(c["delta"].get("content") or "" for e in self.chunks for c in e.get("choices", []))

    def clean(self) -> bool:
        """One completion: a single id and role delta, one finish reason, [DONE], no error."""
        if self.status != 200 or not self.done or any("error" in e for e in self.chunks):
            return False
        choices = [c for e in self.chunks for c in e.get("choices", [])]
        return (
            len({e.get("id") for e in self.chunks}) == 1
            and sum("role" in c["delta"] for c in choices) == 1
            and sum(1 for c in choices if c.get("finish_reason")) == 1
        )

    @property
    def engine_rounds(self) -> int:
        """Rounds the gateway ran for this request: one, plus each server tool round it announced."""
        return 1 + sum(1 for e in self.chunks if "ampd_tool_round" in e)

    def message(self) -> dict:
        """The assistant turn, as the conversation continues with it."""
        reply = Reply(started=0.0)
        for chunk in self.chunks:
            if "choices" in chunk:
                reply.observe(chunk, 0.0)
        return reply.message()


async def stream(client: httpx.AsyncClient, url: str, body: dict, session_id: str) -> Streamed:
    chunks, done = [], False
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"X-Session-Id": session_id}) as response:  # fmt: skip
        if response.status_code != 200:
            await response.aread()
            return Streamed(response.status_code, [{"error": response.text[:200]}], False)
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return Streamed(200, chunks, done)


@dataclass
class Cluster:
    """The parts, restartable on their ports; ``url`` is where each answers."""

    state: Path
    speed: float
    redis_binary: tuple[str, str]
    redis: LocalRedis | SentinelRedis
    workers: dict[str, Child] = field(default_factory=dict)  # prefill, decode0, decode1
    gateways: list[Child] = field(default_factory=list)
    tools: subprocess.Popen | None = None

    @property
    def common(self) -> list[str]:
        return ["--redis-url", self.redis.url, "--redis-prefix", PREFIX]

    def start_worker(self, name: str, port: int) -> Child:
        role = "prefill" if name == "prefill" else "decode"
        child = spawn_sim_worker(name, port, ["--role", role, "--speed", str(self.speed), *self.common],
                                 log=self.state / f"{name}.log")  # fmt: skip
        self.workers[name] = child
        return child

    def start_gateway(self, index: int, port: int) -> Child:
        child = spawn_gateway(f"gateway{index}", port, self.common, log=self.state / f"gateway{index}.log")
        if index < len(self.gateways):
            self.gateways[index] = child
        else:
            self.gateways.append(child)
        return child

    def start_tools(self) -> None:
        self.tools = spawn_tools_worker(self.redis.url, PREFIX, self.state / "tools.log")
        if not tools_worker_ready(self.redis.url, PREFIX, self.tools):
            raise RuntimeError(f"the tools worker did not start; see {self.state / 'tools.log'}")

    def stop(self) -> None:
        for child in [*self.gateways, *self.workers.values()]:
            child.stop()
        if self.tools is not None and self.tools.poll() is None:
            os.killpg(self.tools.pid, signal.SIGKILL)
        self.redis.stop()


def _port(child: Child) -> int:
    return int(child.url.rsplit(":", 1)[1])


async def inject(cluster: Cluster, part: str, down_s: float, rng: random.Random) -> None:
    """SIGKILL ``part`` (one of FAULTS; a random decode worker or replica) and bring it back."""
    if part in ("decode", "prefill"):
        name = rng.choice(["decode0", "decode1"]) if part == "decode" else "prefill"
        victim = cluster.workers[name]
        victim.process.kill()
        await asyncio.sleep(down_s)
        cluster.start_worker(name, _port(victim))
    elif part == "gateway":
        index = rng.randrange(len(cluster.gateways))
        victim = cluster.gateways[index]
        victim.process.kill()
        await asyncio.sleep(down_s)
        cluster.start_gateway(index, _port(victim))
    elif part == "redis" and isinstance(cluster.redis, SentinelRedis):
        old = await asyncio.to_thread(cluster.redis.kill_primary)
        await asyncio.to_thread(cluster.redis.failed_over, old, 60.0)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(cluster.redis.restart, old)
    elif part == "redis":
        port = int(cluster.redis.url.rsplit(":", 1)[1].split("/")[0])
        cluster.redis.process.kill()
        await asyncio.sleep(down_s)
        cluster.redis = start_private_redis(cluster.redis_binary, port, cluster.state / "redis")
    elif part == "tools" and cluster.tools is not None:
        os.killpg(cluster.tools.pid, signal.SIGKILL)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(cluster.start_tools)


def session_body(seed: int, k: int, rounds: int, server_tool: bool, messages: list[dict]) -> dict:
    """Round ``k``'s request: seeded, scripted (a client tool call ends every round but the
    last; with ``server_tool`` the first round also runs python on the gateway's side)."""
    call = {"name": "lookup", "arguments": {"q": "x"}}
    script = [{"output_tokens": 40, "tool_calls": [call]} for _ in range(rounds - 1)] + [{"output_tokens": 60}]
    body = {"messages": messages, "tools": [TOOL], "stream": True, "seed": seed * 100 + k,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if server_tool:
        python = {"name": "python", "arguments": {"code": "print(6 * 7)"}}
        script.insert(0, {"output_tokens": 10, "tool_calls": [python]})
        body["server_tools"] = ["python"]
    body["sim_script"] = {"rounds": script}
    return body


async def agent(
    i: int, cluster: Cluster, client: httpx.AsyncClient, tally: Tally, started: float, deadline: float, rounds: int,
    redis_outages: Callable[[float, float], bool],
) -> None:  # fmt: skip
    n = 0
    while time.monotonic() < deadline:
        session_id, seed = f"chaos-{i}-{n}-{uuid.uuid4().hex[:6]}", zlib.crc32(f"{i}-{n}".encode())
        began, n = time.monotonic(), n + 1
        messages: list[dict] = [{"role": "user", "content": words(seed, 0, 60)}]
        completed, bodies = 0, []
        for k in range(rounds):
            body = session_body(seed, k, rounds, n % 4 == 0, messages)
            got, error = None, ""
            for attempt in range(2):
                url = cluster.gateways[(zlib.crc32(session_id.encode()) + k + attempt) % len(cluster.gateways)].url
                try:
                    got = await stream(client, url, body, session_id)
                except (httpx.HTTPError, json.JSONDecodeError) as exc:
                    got, error = None, type(exc).__name__
                if got is not None and got.clean():
                    break
                tally.retried += attempt == 0
            if got is None or not got.clean():
                why = f"unreachable ({error})" if got is None else "broken stream" if got.status == 200 else ""
                why = why or f"status {got.status}"
                tally.failed[why] = tally.failed.get(why, 0) + 1
                tally.failures.append((round(time.monotonic() - started, 1), why, session_id))
                break
            completed += got.engine_rounds
            tally.rounds_ok += 1
            message = got.message()
            bodies.append((body, got.text))
            messages = [*messages, message]
            if k + 1 < rounds:
                await asyncio.sleep(0.2)
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": words(seed, k + 1, 20)}
                             for c in message.get("tool_calls") or []]  # fmt: skip
        tally.sessions += 1
        await verify(cluster, client, tally, session_id, completed, bodies, partial(redis_outages, began))


async def verify(
    cluster: Cluster, client: httpx.AsyncClient, tally: Tally, session_id: str, completed: int,
    bodies: list[tuple[dict, str]], redis_lost: Callable[[float], bool],
) -> None:  # fmt: skip
    """Read the session's record back and compare; ``redis_lost(now)`` says whether a
    Redis restart fell between the session's start and the read, emptying its record."""
    record, answers = None, []
    for _ in range(10):  # while Redis is away (503) the records cannot be read: wait for it
        for gateway in cluster.gateways:
            try:
                response = await client.get(f"{gateway.url}/v1/sessions/{session_id}")
            except httpx.HTTPError as exc:
                answers.append(type(exc).__name__)
                continue
            answers.append(response.status_code)
            if response.status_code == 200:
                record = response.json()["rounds"]
                break
        if record is not None or 503 not in answers:
            break
        await asyncio.sleep(1.0)
    if redis_lost(time.monotonic()):
        tally.sessions_lost_to_redis += 1
    elif record is None:
        tally.lost_rounds += completed
        if len(tally.mismatched_sessions) < 10:
            tally.mismatched_sessions.append({"session": session_id, "completed": completed, "answers": answers,
                                              "ended_s": time.monotonic()})  # fmt: skip
    else:
        tally.sessions_verified += 1
        tally.lost_rounds += max(0, completed - len(record))
        tally.duplicated_rounds += max(0, len(record) - completed)
        if completed != len(record) and len(tally.mismatched_sessions) < 10:
            rounds = [(r["kind"], r["route"], r["decode_worker"], r["migrations"]) for r in record]
            tally.mismatched_sessions.append({"session": session_id, "completed": completed, "recorded": rounds})
    if any(body.get("server_tools") for body, _ in bodies):
        return  # its record has a round per tool round too: entries and requests do not pair up
    for entry, (body, text) in zip(record or [], bodies, strict=False):
        if not entry.get("migrations"):
            continue
        tally.migrated_rounds += 1
        undisturbed = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        for worker in cluster.workers.values():
            try:
                reference = await client.post(f"{worker.url}/v1/chat/completions", json=undisturbed)
            except httpx.HTTPError:
                continue
            if reference.status_code == 200:
                tally.migrated_checked += 1
                tally.text_mismatches += (reference.json()["choices"][0]["message"]["content"] or "") != text
                break


def run_chaos_bench(
    console: Console, agents: int, minutes: float, interval_s: float, down_s: float, speed: float, rounds: int,
    out: Path | None, seed: int = 0, sentinel: bool = False,
) -> int:  # fmt: skip
    binary = server_binary()
    if binary is None:
        console.print("[red]bench chaos restarts a Redis of its own: redis-server is needed[/red]")
        return 2
    state = Path(".ampd") / f"chaos-{uuid.uuid4().hex[:8]}"
    workdir = state / "redis"
    redis = start_sentinel_redis(binary, workdir) if sentinel else start_private_redis(binary, free_port(), workdir)
    cluster = Cluster(state, speed, binary, redis)
    tally = Tally()
    try:
        starting = [cluster.start_worker(name, free_port()) for name in ("prefill", "decode0", "decode1")]
        if wait_healthy(starting):
            raise RuntimeError(f"a worker did not start; logs in {state}")
        cluster.start_tools()
        replicas = [cluster.start_gateway(i, free_port()) for i in range(2)]
        if wait_healthy(replicas, path="/readyz"):
            raise RuntimeError(f"a gateway did not start; logs in {state}")
        asyncio.run(_run(cluster, tally, agents, minutes * 60, interval_s, down_s, rounds, seed))
    finally:
        cluster.stop()
    print_report(console, tally, minutes)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"agents": agents, "minutes": minutes, "interval_s": interval_s, "down_s": down_s,
                                   "speed": speed, "rounds": rounds, "sentinel": sentinel, **asdict(tally)},
                                  indent=2) + "\n")  # fmt: skip
    # Duplicates up to the retries are the clients' retries of requests a killed replica had run.
    unexplained = max(0, tally.duplicated_rounds - tally.retried)
    bad = sum(tally.failed.values()) + tally.text_mismatches + tally.lost_rounds + unexplained
    return 0 if bad == 0 else 1


async def _run(
    cluster: Cluster, tally: Tally, agents: int, seconds: float, interval_s: float, down_s: float, rounds: int,
    seed: int,
) -> None:  # fmt: skip
    started = time.monotonic()
    deadline = started + seconds
    outages: list[tuple[float, float]] = []

    def redis_outages(begin: float, end: float) -> bool:
        return any(a <= end and begin <= b for a, b in outages)

    async def chaos() -> None:
        rng = random.Random(seed)
        k = 0
        while time.monotonic() + interval_s < deadline:
            await asyncio.sleep(interval_s)
            part = FAULTS[k % len(FAULTS)]
            k += 1
            at = time.monotonic()
            tally.faults.append((round(at - started, 1), part))
            emptied = part == "redis" and isinstance(cluster.redis, LocalRedis)  # a sentinel's replica keeps it
            if emptied:
                outages.append((at, float("inf")))
            await inject(cluster, part, down_s, rng)
            if emptied:  # closed once the replicas have surely reconnected
                outages[-1] = (at, time.monotonic() + 5.0)

    limits = httpx.Limits(max_connections=agents * 2 + 16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits) as client:
        await asyncio.gather(chaos(), *(agent(i, cluster, client, tally, started, deadline, rounds, redis_outages)
                                        for i in range(agents)))  # fmt: skip


def print_report(console: Console, tally: Tally, minutes: float) -> None:
    faults = Counter(part for _, part in tally.faults)
    console.print(f"{minutes:g} min, faults injected: " + ", ".join(f"{p} x{faults[p]}" for p in FAULTS))
    table = Table("rounds ok", "retried on the other replica", "failed", "migrated (text checked / mismatched)",
                  "sessions verified", "lost / duplicated rounds", "sessions whose record Redis lost")  # fmt: skip
    table.add_row(str(tally.rounds_ok), str(tally.retried), str(sum(tally.failed.values())),
                  f"{tally.migrated_rounds} ({tally.migrated_checked} / {tally.text_mismatches})",
                  f"{tally.sessions_verified} of {tally.sessions}", f"{tally.lost_rounds} / {tally.duplicated_rounds}",
                  str(tally.sessions_lost_to_redis))  # fmt: skip
    console.print(table)
    for kind, n in tally.failed.items():
        console.print(f"  failed x{n}: {kind}")
