"""Python-level calls a gateway makes per request and per streamed chunk: ampd against the
bare relay (bench.relay), counted by cProfile.

A one-off harness, not part of the package. Call counts do not depend on how fast or busy
the machine is, where every timing here does. One GPU-free worker on core 0; each arm
runs under cProfile on core 1 three times, fresh each time: 64 streams of 5 and of 10
requests of 2 output tokens, then of 10 requests of 128. The calls per request are the
difference between the first two runs, those per chunk between the last two, so what a
process's start and shutdown cost cancels out; its background work (heartbeats,
scrapes) runs longer in the 128-token run and counts a little towards the chunks. A
gateway that falls behind reads several chunks at once, so calls made once per read (the
event loop's, the generators carrying a read to the client) count less than once per
chunk.

    .venv/bin/python bench/studies/overhead_hot_path/calls_per_chunk.py

Output of the run behind the overhead study: bench/results/overhead/hot_path/calls_per_chunk.txt.
"""

import asyncio
import cProfile
import os
import pstats
import runpy
import signal
import subprocess
import sys
from pathlib import Path

from one_worker import Bench, one_worker

from ampd.local_redis import free_port
from ampd.processes import Child, ampd_argv, wait_healthy
from bench.gateway import drive
from bench.relay import relay_argv

STREAMS = 64
RUNS = ((2, 5), (2, 10), (128, 10))  # (output tokens, requests per stream)


def profiled(out: str, module: str, *args: str) -> None:
    """``python -m module *args`` under cProfile (the child's side); stats to ``out`` at exit."""
    sys.argv = [module, *args]
    profile = cProfile.Profile()
    profile.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        profile.disable()
        profile.dump_stats(out)


def calls(path: Path) -> dict[str, int]:
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    return {f"{file.rsplit('/', 2)[-1]}:{line}({name})": n for (file, line, name), (_, n, *_) in stats.items()}


def _per(before: dict[str, int], after: dict[str, int], units: int) -> dict[str, float]:
    """Each function's calls of ``after`` beyond ``before``, per unit: what a process's start,
    shutdown and imports cost cancels out."""
    return {k: (after.get(k, 0) - before.get(k, 0)) / units for k in set(before) | set(after)}


def run(arm: str, tokens: int, requests: int, bench: Bench, out: Path) -> int:
    port = free_port()
    if arm == "ampd":
        command = ampd_argv("gateway", "--port", str(port), *bench.registry, "--prefill-slots", "4096")
    else:
        command = relay_argv(port, bench.worker.url)
    _, _, *module_and_args = command  # the interpreter and "-m": the profiler runs the module
    process = subprocess.Popen([sys.executable, __file__, "--profiled", str(out), *module_and_args],
                               stdout=(bench.state / f"{arm}.log").open("ab"), stderr=subprocess.STDOUT,
                               preexec_fn=lambda: os.sched_setaffinity(0, {1}))  # fmt: skip
    proxy = Child(arm, f"http://127.0.0.1:{port}", process)
    try:
        assert wait_healthy([proxy], path="/readyz" if arm == "ampd" else "/health") is None
        return len(asyncio.run(drive(proxy.url, bench.model, STREAMS, requests, tokens)))
    finally:
        process.send_signal(signal.SIGINT)  # uvicorn shuts down; the profile is written
        process.wait(timeout=60)


def main() -> None:
    with one_worker("calls", "--max-num-seqs", "1024") as bench:
        os.sched_setaffinity(0, {1})  # the load on core 1, beside the profiled proxy
        for arm in ("ampd", "relay"):
            counted = {}
            for tokens, requests in RUNS:
                out = bench.state / f"{arm}-{tokens}-{requests}.prof"
                done = run(arm, tokens, requests, bench, out)
                assert done == STREAMS * requests, (arm, tokens, requests, done)
                counted[tokens, requests] = calls(out)
            few, short, long = (counted[key] for key in RUNS)
            per_request = _per(few, short, STREAMS * (RUNS[1][1] - RUNS[0][1]))
            per_chunk = _per(short, long, STREAMS * RUNS[1][1] * (RUNS[2][0] - RUNS[1][0]))
            print(f"{arm}: {sum(per_request.values()):.0f} calls per {RUNS[0][0]}-token request, "
                  f"{sum(per_chunk.values()):.1f} per further chunk")  # fmt: skip
            for what, per, most in (("request", per_request, 30), ("chunk", per_chunk, 25)):
                print(f"  per {what}, the most:")
                for name, n in sorted(per.items(), key=lambda item: -item[1])[:most]:
                    print(f"    {n:7.2f}  {name}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--profiled"]:
        profiled(*sys.argv[2:])
    else:
        main()
