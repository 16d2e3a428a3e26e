"""Event-loop stalls and collector pauses in every uvicorn process of a run: a one-off
timing harness, not part of the package.

Put this folder first on PYTHONPATH and name a log stem; each uvicorn server the run
starts (the gateway, the GPU-free engines) then writes ``<stem>.<pid>``: its command
line, every collection with its generation, wall time and pause (ms), and every time a
2 ms sleep of its event loop overshot by more than 4 ms (the loop was busy or stalled).

    LAG_LOG=/tmp/lag PYTHONPATH=bench/studies/load_gc/pauses \
        .venv/bin/ampd bench load --minutes 4 --baseline-minutes 1

The waking loop costs each process ~500 wake-ups a second: compare runs made with it.
Output of the runs behind the engine study: bench/results/load/gc/engine_pauses.txt.
"""

import os
import sys

if os.environ.get("LAG_LOG"):
    import asyncio
    import gc
    import time

    import uvicorn.server

    _serve = uvicorn.server.Server.serve

    async def _watch(path: str) -> None:
        log = open(path, "w", buffering=1)  # noqa: SIM115 - open for the process's life
        log.write(" ".join(sys.argv) + "\n")
        started: list[float] = []

        def collected(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            else:
                pause = (time.perf_counter() - started.pop()) * 1e3
                log.write(f"gc {info['generation']} {time.time():.3f} {pause:.2f}\n")

        gc.callbacks.append(collected)
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.002)
            late = time.perf_counter() - before - 0.002
            if late > 0.004:
                log.write(f"lag {time.time():.3f} {late * 1e3:.1f}\n")

    async def serve(self, *args, **kwargs):
        watcher = asyncio.get_running_loop().create_task(_watch(f"{os.environ['LAG_LOG']}.{os.getpid()}"))
        try:
            return await _serve(self, *args, **kwargs)
        finally:
            watcher.cancel()

    uvicorn.server.Server.serve = serve
