"""Windowed means of TTFT and ITL per (series, worker), in one process's memory. Pure: no I/O.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 3) keeps,
per worker, the mean TTFT and ITL over the last 10 s so that routing sees the whole
system. The simulator keeps them here; the live gateway keeps the same arithmetic in
Redis, shared by its replicas (gateway.state.stats), on the same one-second buckets.
"""

from __future__ import annotations

import math

from rounds.core import Observation


def bucket(now: float) -> int:
    """The one-second bucket an observation at ``now`` goes to."""
    return math.floor(now)


def first_bucket(now: float, window_s: int) -> int:
    """The oldest bucket of the window that ends with ``now``'s."""
    return bucket(now) - window_s + 1


class WindowedMeans:
    """The same statistics in one process's memory (the simulator's). A mean is summed once
    per (series, worker) until an observation or the window's start changes it: a planned
    cluster's routing reads every prefill worker's mean every round."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self.buckets: dict[tuple[str, str], dict[int, list[float]]] = {}
        self._summed: dict[tuple[str, str], tuple[int, float | None]] = {}  # (window's first bucket, mean)

    def record(self, o: Observation, now: float) -> None:
        if o.count <= 0:
            return
        second = bucket(now)
        buckets = self.buckets.setdefault((o.series, o.worker_id), {})
        held = buckets.setdefault(second, [0.0, 0])
        held[0] += o.total
        held[1] += o.count
        for old in [s for s in buckets if s <= second - self.window_s]:
            del buckets[old]
        self._summed.pop((o.series, o.worker_id), None)

    def mean(self, series: str, worker_id: str, now: float) -> float | None:
        first = first_bucket(now, self.window_s)
        summed = self._summed.get((series, worker_id))
        if summed is not None and summed[0] == first:
            return summed[1]
        buckets = self.buckets.get((series, worker_id))
        if not buckets:
            return None
        total = count = 0.0
        for second, (s, n) in buckets.items():
            if second >= first:
                total += s
                count += n
        mean = total / count if count else None
        self._summed[(series, worker_id)] = (first, mean)
        return mean
