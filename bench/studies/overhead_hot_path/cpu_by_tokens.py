"""A gateway's CPU per request split into what each request costs and what each streamed
chunk costs: ampd against the bare relay (bench.relay), the floor of its stack.

A one-off harness, not part of the package. One GPU-free worker on core 0, the load
generator on core 1 (as `ampd bench overhead` places them), then for each arm: its idle
CPU over 10 s (heartbeats, scrapes), and 64 streams of 20 streamed requests at 2, 32
and 128 output tokens, twice, with the arm's user and system CPU per request read from
/proc. The fixed cost and the cost per chunk are the least-squares line through the six
points, each less its share of the idle CPU (which a slow run would otherwise charge to
its every request as if it were the chunks').

    .venv/bin/python bench/studies/overhead_hot_path/cpu_by_tokens.py

Output of the run behind the overhead study: bench/results/overhead/hot_path/cpu_by_tokens.txt.
"""

import asyncio
import os
import subprocess
import time
from pathlib import Path

import numpy as np
from one_worker import Bench, one_worker

from ampd.local_redis import free_port
from ampd.processes import Child, spawn_gateway, wait_healthy
from bench.gateway import drive
from bench.relay import relay_argv

STREAMS, REQUESTS, TOKENS = 64, 20, (2, 32, 128)


def cpu(pid: int) -> tuple[float, float]:
    """User and system seconds of ``pid`` (clock ticks of 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / 100, int(fields[12]) / 100


def start(arm: str, bench: Bench) -> Child:
    if arm == "ampd":
        return spawn_gateway(
            "ampd", free_port(), [*bench.registry, "--prefill-slots", "4096"], bench.state / "ampd.log"
        )
    port = free_port()
    return Child("relay", f"http://127.0.0.1:{port}", subprocess.Popen(relay_argv(port, bench.worker.url)))


def main() -> None:
    with one_worker("cpu", "--max-num-seqs", "1024") as bench:
        os.sched_setaffinity(0, {1})  # the proxies it starts, and the load, on core 1
        for arm in ("ampd", "relay"):
            proxy = start(arm, bench)
            try:
                assert wait_healthy([proxy], path="/readyz" if arm == "ampd" else "/health") is None
                asyncio.run(drive(proxy.url, bench.model, 4, 2, 4))
                user, system = cpu(proxy.process.pid)
                time.sleep(10)
                idle = sum(cpu(proxy.process.pid)) - user - system
                print(f"{arm}: idle {idle * 100:.1f} ms of CPU a second", flush=True)
                points = []
                for _ in range(2):
                    for tokens in TOKENS:
                        user, system = cpu(proxy.process.pid)
                        started = time.perf_counter()
                        n = len(asyncio.run(drive(proxy.url, bench.model, STREAMS, REQUESTS, tokens)))
                        wall = time.perf_counter() - started
                        u, s = (x - y for x, y in zip(cpu(proxy.process.pid), (user, system), strict=True))
                        points.append((tokens, (u + s - idle / 10 * wall) * 1000 / n))
                        print(f"  {tokens:>3} tokens: user {u * 1000 / n:.3f} + system {s * 1000 / n:.3f} ms "
                              f"per request ({points[-1][1]:.3f} less idle), {n / wall:.0f} requests/s",
                              flush=True)  # fmt: skip
                slope, fixed = np.polyfit([t for t, _ in points], [c for _, c in points], 1)
                print(
                    f"  {arm}: {fixed:.3f} ms per request + {slope * 1000:.1f} us per chunk (idle removed)", flush=True
                )
            finally:
                proxy.stop()


if __name__ == "__main__":
    main()
