"""Where the latency ampd adds at one stream goes, phase by phase.

A one-off timing harness, not part of the package: the gateway runs in a child process of
this script with timestamps taken around its phases (by wrapping the coordinator's
``open``, the session and signals read, its ``OPEN`` script, the prompt's count, the
prefill queue's ``submit`` and the engine client's ``stream``, and the ASGI app itself);
one GPU-free worker on core 0; 100 streamed requests of 32 tokens, one after another,
then 50 straight to the worker. Prints the median of each step and of each phase's time
since the request reached the app over the last 50 requests, and both client-side TTFT
medians.

    .venv/bin/python bench/studies/overhead_hot_path/phase_breakdown.py

Output of the run behind the overhead study: bench/results/overhead/hot_path/phases_one_stream.txt.
"""

import asyncio
import os
import statistics
import subprocess
import sys
import time

# In the order they happen; the prompt is counted while the OPEN script is out, so the
# steps between script_start and reads_done overlap (the times from "asgi" show it).
PHASES = ["asgi", "open_start", "read_start", "script_start", "count_start", "count_done", "script_done",
          "reads_done", "open_done", "submit_start", "submit_done", "post", "engine_first", "client_first"]  # fmt: skip


def serve(redis_url: str, prefix: str, port: int) -> None:
    import uvicorn

    import gateway.coordinator as coordinator
    import gateway.engines.upstream as upstream
    import gateway.state.prefill_queue as prefill_queue
    import gateway.state.redis_batch as redis_batch
    from gateway.apis.app import create_app
    from gateway.config import GatewayConfig

    stamps: dict[str, float] = {}
    rows: list[dict[str, float]] = []

    def timed(cls, name: str, before: str | None, after: str) -> None:
        inner = getattr(cls, name)

        async def wrapper(*args, **kwargs):
            if before and before not in stamps:  # a round's first call (OPEN is its first script)
                stamps[before] = time.perf_counter()
            out = await inner(*args, **kwargs)
            if after not in stamps:
                stamps[after] = time.perf_counter()
            return out

        setattr(cls, name, wrapper)

    timed(coordinator.Gateway, "open", "open_start", "open_done")
    timed(coordinator.RoundReads, "read", "read_start", "reads_done")
    timed(coordinator.Gateway, "_count", "count_start", "count_done")
    timed(redis_batch.RedisBatch, "script", "script_start", "script_done")
    timed(prefill_queue.PrefillQueues, "submit", "submit_start", "submit_done")
    stream = upstream.EngineClient.stream

    async def first_chunk(*args, **kwargs):
        stamps["post"], first = time.perf_counter(), True
        async for events in stream(*args, **kwargs):
            if first:
                stamps["engine_first"], first = time.perf_counter(), False
            yield events

    upstream.EngineClient.stream = first_chunk
    app = create_app(GatewayConfig(redis_url=redis_url, key_prefix=prefix, prefill_slots=4096))

    async def asgi(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await app(scope, receive, send)
        stamps.clear()
        stamps["asgi"] = time.perf_counter()

        async def sending(message):
            if message["type"] == "http.response.body" and message.get("body") and "client_first" not in stamps:
                stamps["client_first"] = time.perf_counter()
            await send(message)

        await app(scope, receive, sending)
        rows.append(dict(stamps))
        if len(rows) == 100:
            done = [r for r in rows[50:] if all(k in r for k in PHASES)]
            print(f"phase medians over {len(done)} requests (ms):", flush=True)
            for a, b in zip(PHASES, PHASES[1:], strict=False):
                print(f"  {a:>13} -> {b:<13} {statistics.median(r[b] - r[a] for r in done) * 1000:7.3f}", flush=True)
            for phase in PHASES[1:]:
                since = statistics.median(r[phase] - r["asgi"] for r in done) * 1000
                print(f"  {'asgi':>13} -> {phase:<13} {since:7.3f}", flush=True)
            total = statistics.median(r["client_first"] - r["asgi"] for r in done) * 1000
            print(f"  {'asgi':>13} -> {'client_first':<13} {total:7.3f}", flush=True)

    uvicorn.run(asgi, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on")


def main() -> None:
    from one_worker import one_worker

    from ampd.local_redis import free_port
    from ampd.processes import Child, wait_healthy
    from bench.gateway import drive

    with one_worker("phases") as bench:
        port = free_port()
        serve_argv = [sys.executable, __file__, "serve", bench.redis.url, bench.prefix, str(port)]
        gateway = Child("g", f"http://127.0.0.1:{port}", subprocess.Popen(serve_argv))
        try:
            if wait_healthy([gateway], path="/readyz"):
                raise RuntimeError("the gateway did not start")
            os.sched_setaffinity(0, {1})  # the client on core 1; the gateway was started unpinned
            for label, url, n in (("ampd", gateway.url, 100), ("direct", bench.worker.url, 50)):
                ttft = sorted(t.ttft for t in asyncio.run(drive(url, bench.model, 1, n, 32))[n // 2 :])
                print(f"client TTFT p50 {label}: {ttft[len(ttft) // 2] * 1000:.2f} ms", flush=True)
        finally:
            gateway.stop()


if __name__ == "__main__":
    serve(sys.argv[2], sys.argv[3], int(sys.argv[4])) if sys.argv[1:2] == ["serve"] else main()
