"""Which decode worker a new session is bound to (AMPD step 1). Pure: no I/O.

shared/seeds/003_517589c8db448ff1.txt, section 3: a session is bound to a decode worker
by memory usage, as Dynamo's KV router does; that worker keeps the session's KV and
runs all its decoding. Scraped KV usage lags - a session's KV reaches its decode
worker only once its first prefill has run, queued and perhaps on a prefill worker -
so sessions this gateway bound whose first round has not reached its decode worker
count too: otherwise a burst of new sessions would all land on the worker that
looked emptiest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeCandidate:
    worker_id: str
    kv_usage: float  # vllm:kv_cache_usage_perc at the last scrape, 0..1
    kv_capacity_tokens: int
    arriving_tokens: int = 0  # prompt tokens of sessions bound here whose KV is not there yet

    @property
    def expected_usage(self) -> float:
        return self.kv_usage + self.arriving_tokens / max(self.kv_capacity_tokens, 1)


def choose_decode_worker(candidates: Sequence[DecodeCandidate]) -> str:
    if not candidates:
        raise ValueError("no decode worker to bind to")
    return min(candidates, key=lambda c: (c.expected_usage, c.worker_id)).worker_id
