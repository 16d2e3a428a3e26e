"""`ampd bench signals`: what Redis spends on a round's windowed statistics, by pool size.

Every client round reads the windowed TTFT mean of each prefill worker it could use and
the ITL mean of its decode worker (gateway.state.scripts: SIGNALS, inside OPEN), and writes its
own observations when it closes (OBSERVE). This drives both scripts against a private
Redis in virtual time - ``rate`` rounds a second, each reading every pool member's mean
and adding a TTFT and an ITL observation - and reports Redis's own microseconds per call
from ``INFO commandstats`` (a private server: nothing else is counted), so the load
generator's Python and the loopback are not counted either.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from ampd.local_redis import NoRedis, free_port, server_binary, start_private_redis
from gateway.state import scripts
from gateway.state.stats import WindowedStats
from rounds.core import ITL, TTFT_REMOTE, Observation

START = 1_800_000_000.0  # virtual seconds: any epoch-like time


def _per_call_us(client: redis.Redis, command: str) -> float:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return float(stats.get("usec_per_call", 0.0))


def measure(client: redis.Redis, workers: int, rounds: int, rate: float, window_s: int) -> dict[str, float]:
    """Redis microseconds per read and per write of one round's statistics, ``workers``
    prefill workers in the pool, after a window's worth of rounds to fill the statistics."""
    stats = WindowedStats(f"bench-signals-{workers}", window_s)
    prefills = [f"prefill-{i}" for i in range(workers)]
    wanted = [(ITL, "decode-0"), *((TTFT_REMOTE, p) for p in prefills)]
    read_sha = client.script_load(scripts.SIGNALS)
    rng = random.Random(workers)
    warmup = int(rate * window_s)

    def one(now: float) -> None:
        client.evalsha(read_sha, 0, "none", now, 0, *stats.means_args(wanted, now))
        observed = [Observation(TTFT_REMOTE, rng.choice(prefills), rng.uniform(0.05, 0.5), 1),
                    Observation(ITL, "decode-0", rng.uniform(0.5, 2.0), 40)]  # fmt: skip
        pipe = client.pipeline(transaction=False)  # the close's write, as the gateway stages it
        stats.record(pipe, observed, now)
        pipe.execute()

    for i in range(warmup):
        one(START + i / rate)
    client.config_resetstat()
    for i in range(warmup, warmup + rounds):
        one(START + i / rate)
    return {"means": len(wanted), "read_us": _per_call_us(client, "evalsha"), "write_us": _per_call_us(client, "eval")}


def run_signals_bench(
    console: Console, levels: list[int], rounds: int, rate: float, window_s: int, out: Path | None
) -> int:
    binary = server_binary()
    if binary is None:
        raise NoRedis("the benchmark starts a Redis of its own: no redis-server is installed")
    with tempfile.TemporaryDirectory() as workdir:
        server = start_private_redis(binary, free_port(), Path(workdir))
        try:
            client = redis.Redis.from_url(server.url, decode_responses=True)
            results = {n: measure(client, n, rounds, rate, window_s) for n in levels}
        finally:
            server.stop()
    table = Table(title=f"Redis's time per round on its windowed statistics ({rate:g} rounds/s, {window_s} s window)")
    table.add_column("prefill workers", justify="right")
    table.add_column("means read", justify="right")
    table.add_column("read (us)", justify="right")
    table.add_column("write (us)", justify="right")
    for n, r in results.items():
        table.add_row(str(n), str(r["means"]), f"{r['read_us']:.1f}", f"{r['write_us']:.1f}")
    console.print(table)
    if out is not None:
        out.write_text(json.dumps({"rate": rate, "window_s": window_s, "rounds": rounds, "levels": results}, indent=2))
        console.print(f"wrote {out}")
    return 0
