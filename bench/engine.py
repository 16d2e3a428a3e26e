"""`ampd bench engine`: how many concurrent streams one sim worker keeps on time.

The worker runs pinned to one core, the load generator on another. At each level of
concurrency N, N streaming requests start together and decode ``output_tokens``
tokens each (ignore_eos); the mean inter-token latency the clients see is compared
with the profile's prediction for a decode batch of N, T_dec(N, context) / speed.
The result is the largest N whose ITL stays within the tolerance.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ampd.processes import spawn_sim_worker, wait_healthy
from bench.loadgen import stream_chat
from perfmodel.profile import load_profile


@dataclass
class Level:
    streams: int
    predicted_itl_ms: float
    measured_itl_ms: float
    p99_stream_itl_ms: float

    @property
    def excess(self) -> float:
        return self.measured_itl_ms / self.predicted_itl_ms - 1


async def _level(url: str, model: str, streams: int, output_tokens: int) -> list[float]:
    bodies = [
        json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": f"stream {i} of the engine benchmark"}],
                "max_tokens": output_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        for i in range(streams)
    ]
    results = await asyncio.gather(*(stream_chat(url, b) for b in bodies))
    if any(r.events < output_tokens for r in results):
        raise RuntimeError(f"a stream delivered fewer events than its {output_tokens} tokens")
    return [(r.last_event - r.first_event) / (output_tokens - 1) for r in results]


def run_engine_bench(
    console: Console, profile: str, speed: float, tolerance: float, output_tokens: int, port: int, out: Path | None
) -> int:
    prof = load_profile(profile)
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # the load generator stays off the worker's core
    options = ["--profile", profile, "--speed", str(speed), "--max-num-seqs", "4096"]
    worker = spawn_sim_worker("sim worker", port, options, cpu=0)
    if wait_healthy([worker], timeout_s=30) is not None:
        worker.stop()
        raise RuntimeError("the sim worker did not start")
    url = worker.url
    levels: list[Level] = []
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        prompt_tokens = httpx.post(
            f"{url}/tokenize", json={"messages": [{"role": "user", "content": "stream 0 of the engine benchmark"}]}
        ).json()["count"]

        def measure(n: int) -> Level:
            itls = asyncio.run(_level(url, model, n, output_tokens))
            predicted = statistics.mean(prof.t_dec(n, n * (prompt_tokens + k)) for k in range(1, output_tokens)) / speed
            ordered = sorted(itls)
            return Level(n, predicted * 1e3, statistics.mean(itls) * 1e3, ordered[int(0.99 * (len(ordered) - 1))] * 1e3)

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("streams", total=None)
            n, good, bad = 1, 0, 0
            while n <= 4096:
                progress.update(task, description=f"{n} concurrent streams")
                level = measure(n)
                levels.append(level)
                if level.excess > tolerance:
                    bad = n
                    break
                good, n = n, n * 2
            while bad and bad - good > max(1, good // 8):  # bisect between the last pass and the first miss
                mid = (good + bad) // 2
                progress.update(task, description=f"{mid} concurrent streams")
                level = measure(mid)
                levels.append(level)
                good, bad = (mid, bad) if level.excess <= tolerance else (good, mid)
    finally:
        worker.stop()

    table = Table("streams", "model ITL", "measured ITL", "excess", "p99 stream ITL")
    for level in sorted(levels, key=lambda x: x.streams):
        table.add_row(
            str(level.streams),
            f"{level.predicted_itl_ms:.3f} ms",
            f"{level.measured_itl_ms:.3f} ms",
            f"{level.excess:+.1%}",
            f"{level.p99_stream_itl_ms:.3f} ms",
        )
    console.print(table)
    console.print(
        f"[bold]{profile} at speed {speed:g}: one worker core sustains {good} concurrent streams "
        f"within {tolerance:.0%} of the modelled ITL[/bold]"
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "profile": profile,
                    "speed": speed,
                    "tolerance": tolerance,
                    "output_tokens": output_tokens,
                    "sustained_streams": good,
                    "levels": [asdict(x) | {"excess": x.excess} for x in levels],
                },
                indent=2,
            )
            + "\n"
        )
    return 0
