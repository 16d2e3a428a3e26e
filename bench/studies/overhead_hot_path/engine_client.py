"""A decode stream's cost to the gateway's client side: aiohttp against gateway.engines.connections.

A one-off timing harness, not part of the package: one GPU-free worker on core 0, this
process on core 1. For each client, alternately, in one session:
- one stream at a time (worker at speed 1): the median time from the call to the
  response's headers and to its first event, over 80 streamed requests of 32 tokens;
- 32 concurrent streams of 20 requests (worker at speed 50, so that the client is what is
  measured): this process's CPU per request, from getrusage.

    .venv/bin/python bench/studies/overhead_hot_path/engine_client.py

Output of the run behind the overhead study: bench/results/overhead/ab/engine_connections/client_alone.txt.
"""

import asyncio
import os
import resource
import statistics
import time
import uuid
from pathlib import Path

import aiohttp
import httpx
import orjson
import uvloop

from ampd.local_redis import free_port
from ampd.processes import spawn_sim_worker, wait_healthy
from gateway.engines.connections import EngineConnections

HEADERS = {"Content-Type": "application/json"}


def body(model: str) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": f"bench {uuid.uuid4().hex}"}],
                         "max_tokens": 32, "ignore_eos": True, "stream": True})  # fmt: skip


async def with_aiohttp(url: str, model: str, n: int, stamps: list[tuple[float, float]]) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)) as session:
        for _ in range(n):
            started, first = time.perf_counter(), 0.0
            async with session.post(f"{url}/v1/chat/completions", data=body(model), headers=HEADERS) as r:
                headers = time.perf_counter()
                async for data in r.content.iter_any():
                    first = first or (time.perf_counter() if b"data: {" in data else 0.0)
            stamps.append((headers - started, first - started))


async def with_connections(url: str, model: str, n: int, stamps: list[tuple[float, float]]) -> None:
    pool = EngineConnections(keepalive_s=4.0, connect_timeout_s=5.0, timeout_s=600.0)
    try:
        for _ in range(n):
            started, first = time.perf_counter(), 0.0
            async with pool.request("POST", f"{url}/v1/chat/completions", body(model), HEADERS) as r:
                headers = time.perf_counter()
                async for data in r.body():
                    first = first or (time.perf_counter() if b"data: {" in data else 0.0)
            stamps.append((headers - started, first - started))
    finally:
        await pool.close()


CLIENTS = {"aiohttp": with_aiohttp, "engine_connections": with_connections}


async def latency(client: str, url: str, model: str) -> tuple[float, float]:
    stamps: list[tuple[float, float]] = []
    await CLIENTS[client](url, model, 80, stamps)
    kept = stamps[20:]
    return statistics.median(h for h, _ in kept) * 1e3, statistics.median(f for _, f in kept) * 1e3


async def cpu(client: str, url: str, model: str) -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(CLIENTS[client](url, model, 20, []) for _ in range(32)))
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime) / 640 * 1e6


def main() -> None:
    state = Path(".ampd") / f"engine-client-{uuid.uuid4().hex[:6]}"
    state.mkdir(parents=True)
    options = ["--role", "both", "--max-num-seqs", "1024", "--speed"]
    workers = [spawn_sim_worker(f"w{speed}", free_port(), [*options, speed], log=state / f"w{speed}.log", cpu=0)
               for speed in ("1", "50")]  # fmt: skip
    try:
        if wait_healthy(workers):
            raise RuntimeError("a worker did not start")
        model = httpx.get(f"{workers[0].url}/v1/models").json()["data"][0]["id"]
        os.sched_setaffinity(0, {1})
        for _ in range(3):
            for client in CLIENTS:
                headers, first = uvloop.run(latency(client, workers[0].url, model))
                per_request = uvloop.run(cpu(client, workers[1].url, model))
                print(f"{client:>18}: one stream, headers {headers:.3f} ms, first event {first:.3f} ms; "
                      f"32 streams, {per_request:.0f} us CPU per request", flush=True)  # fmt: skip
    finally:
        for worker in workers:
            worker.stop()


if __name__ == "__main__":
    main()
