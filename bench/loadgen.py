"""A cheap load generator for streamed chat completions, shared by the benchmarks.

A bare HTTP/1.1 exchange over asyncio streams rather than an HTTP client library: at
tens of thousands of events a second a library's per-chunk cost would make the load
generator, not the system under test, the bottleneck. Events are counted, not parsed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamTiming:
    sent: float  # perf_counter when the request was written
    first_event: float  # arrival of the first SSE data event (the first token)
    last_event: float
    events: int

    @property
    def ttft(self) -> float:
        return self.first_event - self.sent


async def stream_chat(url: str, body: bytes) -> StreamTiming:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    sent = time.perf_counter()
    await writer.drain()
    first = last = 0.0
    events = 0
    tail = b""
    while chunk := await reader.read(65536):
        now = time.perf_counter()
        window = tail + chunk
        new = window.count(b"data: {") - tail.count(b"data: {")
        if new:
            events += new
            first = first or now
            last = now
        tail = window[-8:]
    writer.close()
    if not events:
        raise RuntimeError(f"no events from {url}: {tail!r}")
    return StreamTiming(sent, first, last, events)
