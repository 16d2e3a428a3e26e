"""The gateway's CPU per request when every request carries an agent's history.

A one-off timing harness, not part of the package: one GPU-free worker at speed 50 on
core 0 (fast enough that the gateway, not the engine, is what is measured), one gateway,
the load generator on core 1; STREAMS closed loops of ROUNDS requests each, every
request a new session carrying TOOL_ROUNDS tool calls and results
(ampd.bench.gateway.agent_history). Prints requests per second and the gateway process's
user + system CPU per request from /proc. Run it from a tree's root, alternating trees
for an A/B (TAG labels the line):

    TAG=after .venv/bin/python bench/results/overhead_hot_path/history_cpu.py 32 8 60
"""

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import httpx

from ampd.bench.gateway import drive
from ampd.bench.overhead import cpu_seconds
from ampd.local_redis import delete_prefix, ensure_redis, free_port
from ampd.processes import spawn_gateway, spawn_sim_worker, wait_healthy


def main(streams: int, rounds: int, tool_rounds: int) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    state = Path(".ampd") / prefix
    state.mkdir(parents=True)
    redis = ensure_redis("redis://127.0.0.1:6379/12", state / "redis")
    registry = ["--redis-url", redis.url, "--redis-prefix", prefix]
    options = ["--role", "both", "--max-num-seqs", "1024", "--speed", "50", *registry]
    worker = spawn_sim_worker("worker", free_port(), options, log=state / "worker.log", cpu=0)
    gateway = None
    try:
        assert not wait_healthy([worker])
        gateway = spawn_gateway("ampd", free_port(), [*registry, "--prefill-slots", "4096"], state / "gateway.log")
        assert not wait_healthy([gateway], path="/readyz")
        model = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"]
        os.sched_setaffinity(0, {1})
        asyncio.run(drive(gateway.url, model, 8, 2, 4, tool_rounds))  # warm
        cpu, started = cpu_seconds(gateway.process.pid), time.perf_counter()
        done = len(asyncio.run(drive(gateway.url, model, streams, rounds, 32, tool_rounds)))
        wall, used = time.perf_counter() - started, cpu_seconds(gateway.process.pid) - cpu
        print(f"{os.environ.get('TAG', '')} streams {streams} tool_rounds {tool_rounds}: "
              f"{done / wall:.0f} req/s, CPU/request {used * 1000 / done:.2f} ms")  # fmt: skip
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        delete_prefix(redis.url, prefix)
        redis.stop()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
