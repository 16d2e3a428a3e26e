"""The gateway's CPU per request when every request carries an agent's history.

A one-off timing harness, not part of the package: one GPU-free worker at speed 50 on
core 0 (fast enough that the gateway, not the engine, is what is measured), one gateway,
the load generator on core 1; STREAMS closed loops of ROUNDS requests each, every
request a new session carrying TOOL_ROUNDS tool calls and results
(bench.gateway.agent_history). Prints requests per second and the gateway process's
user + system CPU per request from /proc. Run it from a tree's root, alternating trees
for an A/B (TAG labels the line):

    TAG=after .venv/bin/python bench/studies/overhead_hot_path/history_cpu.py 32 8 60
"""

import asyncio
import os
import sys
import time

from one_worker import one_worker

from ampd.local_redis import free_port
from ampd.processes import spawn_gateway, wait_healthy
from bench.gateway import drive
from bench.overhead import cpu_seconds


def main(streams: int, rounds: int, tool_rounds: int) -> None:
    with one_worker("bench", "--max-num-seqs", "1024", "--speed", "50") as bench:
        gateway = spawn_gateway("ampd", free_port(), [*bench.registry, "--prefill-slots", "4096"],
                                bench.state / "gateway.log")  # fmt: skip
        try:
            assert not wait_healthy([gateway], path="/readyz")
            os.sched_setaffinity(0, {1})
            asyncio.run(drive(gateway.url, bench.model, 8, 2, 4, tool_rounds))  # warm
            cpu, started = cpu_seconds(gateway.process.pid), time.perf_counter()
            done = len(asyncio.run(drive(gateway.url, bench.model, streams, rounds, 32, tool_rounds)))
            wall, used = time.perf_counter() - started, cpu_seconds(gateway.process.pid) - cpu
            print(f"{os.environ.get('TAG', '')} streams {streams} tool_rounds {tool_rounds}: "
                  f"{done / wall:.0f} req/s, CPU/request {used * 1000 / done:.2f} ms")  # fmt: skip
        finally:
            gateway.stop()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
