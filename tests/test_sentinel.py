"""Redis as operators run it: a primary that Redis Sentinel manages, failing over under agent
load. No round is lost or recorded twice, and the sessions go on from the new primary.

A real group: a primary and a replica (``redis-server``, nothing on disk) and three
sentinels (``redis-server --sentinel``, which is what Debian's ``redis-sentinel`` runs),
a majority of two deciding - the smallest group in which no one sentinel decides alone.
Every ampd process is pointed at it by its ``redis+sentinel://`` URL (surface.redis_address).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from typer.testing import CliRunner

from ampd.cli import app
from ampd.local_redis import SENTINEL_SERVICE, SentinelRedis, server_binary, start_sentinel_redis
from bench.chaos import stream
from bench.replay import TOOL, words
from surface.redis_address import RedisAddress
from surface.wire import metric_totals
from tests.engines import kill_group, start_gateway, start_sim_worker, start_tools_worker, stop

AFTER = 3  # rounds every session runs once the new primary is in place
DEADLINE_S = 120.0  # for the whole load, the failover included, on a loaded machine
LOOKUP = {"name": "lookup", "arguments": {"q": "x"}}
CALCULATE = {"name": "calculator", "arguments": {"expression": "6*7"}}


@pytest.mark.unit
def test_sentinel_urls_are_read_and_malformed_ones_refused():
    address = RedisAddress.parse("redis+sentinel://:s%40me@10.0.0.1,10.0.0.2:26380,[::1]:26381/prod-redis/3")
    assert address.managed and address.service == "prod-redis" and address.db == 3
    assert address.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381))
    assert (address.username, address.password) == (None, "s@me")
    plain = RedisAddress.parse("redis://127.0.0.1:6379/0")
    assert not plain.managed and plain.url == "redis://127.0.0.1:6379/0"
    malformed = {
        "redis+sentinel://h1:26379": "is not redis+sentinel://",  # no service
        "redis+sentinel:///mymaster": "is not redis+sentinel://",  # no sentinel
        "redis+sentinel://h1:port/mymaster": "not a sentinel's host[:port]",
        "redis+sentinel://h1,,h2/mymaster": "not a sentinel's host[:port]",
        "redis+sentinel://h1/mymaster/zero": "the database 'zero' is not a number",
        "redis+sentinel://h1/mymaster/0?ssl=true": "takes no query",
        "sentinel://h1/mymaster": "redis://, rediss://, unix://",  # redis-py's own message
    }
    for url, says in malformed.items():
        with pytest.raises(ValueError) as refused:
            RedisAddress.parse(url)
        assert says in str(refused.value), (url, str(refused.value))


def test_a_malformed_sentinel_url_stops_a_process_before_it_starts():
    result = CliRunner().invoke(app, ["tools-worker", "--redis-url", "redis+sentinel://h1:26379/"])
    said = " ".join(result.output.replace("│", " ").split())  # as rich wrapped it into its box
    assert result.exit_code == 2 and "is not redis+sentinel://" in said, result.output


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelRedis]:
    binary = server_binary()
    if binary is None:
        pytest.fail("redis-server is missing (Debian: apt-get install redis-server); the sentinels run as "
                    "`redis-server --sentinel`, so no redis-sentinel binary is needed")  # fmt: skip
    group = start_sentinel_redis(binary, tmp_path / "redis")
    yield group
    group.stop()


@dataclass
class Agent:
    """One agent's session: its conversation so far and the engine rounds it completed."""

    index: int
    session_id: str = field(default_factory=lambda: f"agent-{uuid.uuid4().hex[:8]}")
    messages: list[dict] = field(default_factory=list)
    completed: int = 0
    requests: int = 0

    @property
    def server_tool(self) -> bool:
        return self.index == 0  # its first round has the gateway run a calculator

    async def round(self, client: httpx.AsyncClient, url: str) -> None:
        """One request: a round ending in a call of the client's tool, which it then answers."""
        if not self.messages:
            self.messages = [{"role": "user", "content": words(self.index, 0, 40)}]
        script = ([{"tool_calls": [CALCULATE]}] if self.server_tool else []) + [{"tool_calls": [LOOKUP]}] * 400
        body = {
            "messages": self.messages,
            "tools": [TOOL],
            "stream": True,
            "seed": self.index * 1000 + self.requests,
            "sim_script": {"rounds": script},
            **({"server_tools": ["calculator"]} if self.server_tool else {}),
        }
        got = await stream(client, url, body, self.session_id)
        assert got.clean(), (self.session_id, self.requests, got.status, got.chunks[-3:])
        self.completed, self.requests = self.completed + got.engine_rounds, self.requests + 1
        reply = got.message()
        answers = [{"role": "tool", "tool_call_id": c["id"], "content": words(self.index, self.requests, 8)}
                   for c in reply["tool_calls"]]  # fmt: skip
        self.messages = [*self.messages, reply, *answers]


@pytest.mark.parametrize("how", ["primary killed", "switch-over"])
def test_a_failover_under_agent_load_loses_no_round_and_records_none_twice(tmp_path, group, how):
    """Six agents run sessions of client tool rounds (one also has the gateway run a
    calculator) while the primary is SIGKILLed - or switched over by ``SENTINEL FAILOVER``
    - once every session is two rounds in. Every stream is whole; every session's records
    are its rounds, each once, read from the new primary; and a gateway started afresh
    (nothing of its own held) carries every session on."""
    prefix = f"sentinel-{uuid.uuid4().hex[:8]}"
    registry = ("--redis-url", group.url, "--redis-prefix", prefix, "--speed", "20")
    workers = [start_sim_worker(tmp_path, "--role", role, *registry) for role in ("prefill", "decode")]
    tools = start_tools_worker(tmp_path, group.url, prefix)
    gateway = start_gateway(tmp_path, group.url, prefix, "--redis-failover-wait", "60")
    agents = [Agent(i) for i in range(6)]
    try:
        old, new = asyncio.run(load(gateway.url, group, how, agents))
        assert new != old
        if how == "primary killed":
            assert metrics(gateway.url)["ampd_redis_errors_total"] > 0, "the gateway never felt the failover"
        gateway.stop()
        gateway = start_gateway(tmp_path, group.url, prefix)  # a new process: only Redis remembers
        primary = RedisAddress.parse(group.url).client(decode_responses=True)
        for agent in agents:
            records = records_of(gateway.url, agent.session_id)
            assert [r["round"] for r in records] == list(range(1, agent.completed + 1)), (agent, records)
            assert len({r["request"] for r in records}) == agent.completed
            assert primary.hget(f"{prefix}:session:public:{agent.session_id}", "rounds") == str(agent.completed)
        asyncio.run(carry_on(gateway.url, agents))
    finally:
        gateway.stop()
        kill_group(tools)
        for worker in workers:
            stop(worker)


async def load(url: str, group: SentinelRedis, how: str, agents: list[Agent]) -> tuple[int, int]:
    """The agents' sessions, run through a failover until each has done AFTER rounds on the
    new primary; the primary's port before and after."""
    done, ready = asyncio.Event(), asyncio.Event()
    deadline = time.monotonic() + DEADLINE_S

    async def fail_over() -> tuple[int, int]:
        await ready.wait()
        # Until now a replica acknowledged every round's writes (gateway.state.failover).
        assert (await asyncio.to_thread(metrics, url))["ampd_redis_unreplicated_writes_total"] == 0
        old = await asyncio.to_thread(group.primary)
        assert old is not None
        if how == "primary killed":
            await asyncio.to_thread(group.kill_primary)
        else:
            sentinel = redis.Redis(port=next(iter(group.sentinels)))
            assert await asyncio.to_thread(sentinel.sentinel_failover, SENTINEL_SERVICE)
            sentinel.close()
        new = await asyncio.to_thread(group.failed_over, old, deadline - time.monotonic())
        done.set()
        return old, new

    async def run(agent: Agent, client: httpx.AsyncClient) -> None:
        after = 0
        while after < AFTER:
            assert time.monotonic() < deadline, f"{agent.session_id}: {agent.requests} rounds, the failover not over"
            after += done.is_set()
            await agent.round(client, url)
            if min(a.requests for a in agents) >= 2:
                ready.set()
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=httpx.Timeout(90.0, connect=5.0)) as client:
        *_, (old, new) = await asyncio.gather(*(run(agent, client) for agent in agents), fail_over())
    return old, new


async def carry_on(url: str, agents: list[Agent]) -> None:
    """One more request of every session: its rounds numbered on from the count Redis kept,
    and incremental - the gateway found what the session's engine already holds."""
    async with httpx.AsyncClient(timeout=60.0) as client:
        for agent in agents:
            before = agent.completed
            await agent.round(client, url)
            records = records_of(url, agent.session_id)
            assert [r["round"] for r in records] == list(range(1, agent.completed + 1)), (agent, records)
            assert all(r["kind"] == "incremental" and r["l_hist"] > 0 for r in records[before:]), records[before:]


def records_of(url: str, session_id: str) -> list[dict]:
    return httpx.get(f"{url}/v1/sessions/{session_id}", timeout=30).json()["rounds"]


def metrics(url: str) -> dict[str, float]:
    """The gateway's counters, summed over their labels."""
    return metric_totals(httpx.get(f"{url}/metrics", timeout=30).text)
