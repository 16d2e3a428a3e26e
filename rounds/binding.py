"""Which decode worker a session's rounds run on (AMPD step 1). Pure: no I/O.

"Efficient Multi-round LLM Inference over Disaggregated Serving" (AMPD), section 3: a
session is bound to a decode worker by memory usage, as Dynamo's KV router does; that
worker keeps the session's KV and runs all its decoding. Scraped KV usage lags - a
session's KV reaches its decode worker only once its first prefill has run, queued and
perhaps on a prefill worker - so sessions bound to a worker whose first round has not
reached it count too (:class:`Arrivals`): otherwise a burst of new sessions would all
land on the worker that looked emptiest.
"""

from __future__ import annotations

from collections import Counter
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


class Arrivals:
    """Prompt tokens of sessions bound to a worker that its last scrape cannot show yet.

    A round's KV reaches its decode worker only when its prefill is over (queued, and
    perhaps run on a prefill worker first); until then binding counts it here. Once it
    has landed, a scrape that *starts* afterwards shows it, so each refresh of the
    workers' loads takes what had landed when it began (``scrape_started``) and, with
    the scrapes in, stops counting that (``scraped``).
    """

    def __init__(self) -> None:
        self.tokens: Counter[str] = Counter()
        self._landed: Counter[str] = Counter()

    def expect(self, worker_id: str, tokens: int) -> None:
        self.tokens[worker_id] += tokens

    def landed(self, worker_id: str, tokens: int) -> None:
        self._landed[worker_id] += tokens

    def scrape_started(self) -> Counter[str]:
        landed, self._landed = self._landed, Counter()
        return landed

    def scraped(self, landed: Counter[str]) -> None:
        self.tokens -= landed

    def forget(self, worker_id: str) -> None:
        self.tokens.pop(worker_id, None)
        self._landed.pop(worker_id, None)
