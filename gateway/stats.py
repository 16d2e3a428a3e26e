"""Windowed TTFT/ITL statistics shared by every gateway replica through Redis.

AMPD (section 3) keeps, per worker, the mean TTFT and ITL over the last 10 s in shared
memory so that routing sees the whole system. Here each observation is added to a
one-second bucket (a Redis hash with a sum and a count that expires after the
window); the windowed mean is the sum over the window's buckets divided by their
count. A round contributes its TTFT once and its ITL as (sum of gaps, number of gaps),
so the ITL mean is over tokens, not rounds. Every request reads the statistics, so the
read is one server-side script; writes ride along with the round's other writes.

Series: ``ttft`` per prefill worker (remote rounds), ``ttft_local`` per decode worker
(local rounds), ``itl`` per decode worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from gateway.outage import REDIS_DOWN, RedisHealth

# ARGV: key prefix, first second, window, then (series, worker) pairs; returns sum, count per pair.
_MEANS = """
local out = {}
local first, window = tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 4, #ARGV, 2 do
  local total, count = 0, 0
  for s = first, first + window - 1 do
    local v = redis.call('HMGET', ARGV[1] .. ARGV[i] .. ':' .. ARGV[i + 1] .. ':' .. s, 'sum', 'n')
    if v[2] then total = total + tonumber(v[1]); count = count + tonumber(v[2]) end
  end
  table.insert(out, tostring(total))
  table.insert(out, count)
end
return out
"""


class WindowedStats:
    def __init__(self, redis: aioredis.Redis, prefix: str, window_s: int, health: RedisHealth) -> None:
        self.redis, self.prefix, self.window_s, self.health = redis, f"{prefix}:stat:", window_s, health
        self._means = redis.register_script(_MEANS)

    def record(
        self,
        pipe: aioredis.client.Pipeline,
        observations: Iterable[tuple[str, str, float, int]],
        now: float | None = None,
    ) -> None:
        """Stage (series, worker, sum, count) observations into the current second's
        buckets on ``pipe`` (the caller executes it with its other writes)."""
        second = math.floor(time.time() if now is None else now)
        for series, worker_id, total, count in observations:
            if count > 0:
                key = f"{self.prefix}{series}:{worker_id}:{second}"
                pipe.hincrbyfloat(key, "sum", total)
                pipe.hincrby(key, "n", count)
                pipe.expire(key, self.window_s + 2)

    async def means(self, wanted: Iterable[tuple[str, str]], now: float | None = None) -> dict[tuple[str, str], float]:
        """Windowed mean of each (series, worker) that has samples in the window; none
        while Redis is away (routing then goes by profile estimates: gateway.outage)."""
        wanted = list(wanted)
        if not wanted:
            return {}
        last = math.floor(time.time() if now is None else now)
        args: list[object] = [self.prefix, last - self.window_s + 1, self.window_s]
        for series, worker_id in wanted:
            args += [series, worker_id]
        try:
            flat = await self._means(args=args)
        except REDIS_DOWN as exc:
            self.health.failed("statistics", exc)
            return {}
        out: dict[tuple[str, str], float] = {}
        for item, total, count in zip(wanted, flat[0::2], flat[1::2], strict=True):
            if int(count):
                out[item] = float(total) / int(count)
        return out
