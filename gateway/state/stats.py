"""Windowed TTFT/ITL statistics shared by every gateway replica through Redis.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 3)
keeps, per worker, the mean TTFT and ITL over the last 10 s in shared memory so that
routing sees the whole system. Here each (series, worker) is one Redis hash holding the
window's running sum and count beside each second's own; a read moves the window on to
its second, subtracting the seconds that left it (gateway.state.scripts: ``_WINDOW``), so a
mean costs Redis one hash read however long the window - a planned cluster's round reads
every prefill worker's mean. The windowed mean is the running sum over the running count. A round contributes its
TTFT once and its ITL as (sum of gaps, number of gaps), so the ITL mean is over tokens,
not rounds. Every request reads the statistics, so the read is one server-side script;
writes ride along with the round's other writes. rounds.windowed.WindowedMeans is the same
arithmetic in memory, for the simulator.

The series and what a round observes in them are the round core's (rounds.core).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from gateway.state import scripts
from rounds.core import Observation
from rounds.windowed import bucket, first_bucket


class WindowedStats:
    """The statistics' keys in Redis: written with a round's other writes, read with the
    queue signals in one script (gateway.state.prefill_queue.PrefillQueues.signals)."""

    def __init__(self, prefix: str, window_s: int) -> None:
        self.prefix, self.window_s = f"{prefix}:stat:", window_s

    def record(
        self, pipe: aioredis.client.Pipeline, observations: Iterable[Observation], now: float | None = None
    ) -> None:
        """Stage a round's observations into the current second's buckets on ``pipe`` (the
        caller executes it with its other writes)."""
        second = bucket(time.time() if now is None else now)
        args: list[object] = []
        for o in observations:
            if o.count > 0:
                args += [f"{self.prefix}{o.series}:{o.worker_id}", second, repr(float(o.total)), o.count]
        if args:  # EVAL, not EVALSHA: see gateway.state.sessions.SessionStore.record_round
            pipe.eval(scripts.OBSERVE, 0, self.window_s, self.window_s + 2, *args)

    def means_args(self, wanted: list[tuple[str, str]], now: float | None = None) -> list[object]:
        """The windowed means' part of SIGNALS's arguments (gateway.state.scripts)."""
        args: list[object] = [self.prefix, first_bucket(time.time() if now is None else now, self.window_s),
                              self.window_s]  # fmt: skip
        for series, worker_id in wanted:
            args += [series, worker_id]
        return args

    @staticmethod
    def parse_means(wanted: list[tuple[str, str]], flat: list) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for item, total, count in zip(wanted, flat[0::2], flat[1::2], strict=True):
            if int(count):
                out[item] = float(total) / int(count)
        return out
