"""Running tool calls through rq from the gateway, so that nothing can hang a round.

A call becomes an rq job on the deployment's tools queue. The gateway waits for its
result in short slices and gives up with a tool error - never a hang - when:

* the job failed or hit its rq timeout (the worker killed the work horse);
* the job is running but its worker stopped heartbeating: tools workers heartbeat
  every second (``job_monitoring_interval=1``), so a killed worker is noticed within
  ``stale_after_s``;
* no worker picked the job up before the deadline;
* Redis, which carries the jobs, does not answer, or lost the job.

rq is synchronous; the waiting happens on a dedicated thread pool.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import redis
from rq import Queue
from rq.exceptions import InvalidJobOperation
from rq.job import Job, JobStatus
from rq.results import Result

from tools_sandbox.jobs import run_tool
from tools_sandbox.outcome import Outcome
from tools_sandbox.registry import TOOLS


def queue_name(prefix: str) -> str:
    return f"{prefix}-tools"


class ToolRunner:
    """``connection``: a synchronous client of the deployment's Redis (its caller reads the
    deployment's Redis URL: surface.redis_address, a layer this one does not import)."""

    def __init__(
        self, connection: redis.Redis, prefix: str, queue_wait_s: float = 30.0, stale_after_s: float = 5.0
    ) -> None:
        self.connection = connection
        self.queue = Queue(queue_name(prefix), connection=self.connection)
        self.queue_wait_s, self.stale_after_s = queue_wait_s, stale_after_s
        self._threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="tool-wait")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.connection.close()

    async def run(self, name: str, arguments: str) -> Outcome:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._attempt, name, arguments)

    def _attempt(self, name: str, arguments: str) -> Outcome:
        try:
            return self._run(name, arguments)
        except (redis.RedisError, OSError) as exc:
            return Outcome(False, f"{name} tool error: the tools queue is unavailable ({exc})")
        except InvalidJobOperation:  # its job's record is gone: Redis came back empty, say
            return Outcome(False, f"{name} tool error: the tools queue lost this call")

    def _run(self, name: str, arguments: str) -> Outcome:
        tool = TOOLS.get(name)
        if tool is None:
            return Outcome(False, f"unknown tool {name!r}")
        job = self.queue.enqueue(
            run_tool, name, arguments, job_timeout=int(tool.timeout_s) + 1, result_ttl=600, failure_ttl=600
        )
        deadline = time.monotonic() + self.queue_wait_s + tool.timeout_s
        while True:
            result = job.latest_result(timeout=1)
            if result is not None:
                return _outcome(name, result)
            status = job.get_status(refresh=True)
            if status == JobStatus.STARTED and self._stale(job):
                job.cancel()
                return Outcome(False, f"{name} tool error: the tools worker running this call died")
            if time.monotonic() > deadline:
                job.cancel()
                waiting = "no tools worker picked this call up" if status == JobStatus.QUEUED else "timed out"
                return Outcome(False, f"{name} tool error: {waiting} within {self.queue_wait_s + tool.timeout_s:g} s")

    def _stale(self, job: Job) -> bool:
        job.refresh()
        beat = job.last_heartbeat or job.started_at
        if beat is None:
            return False
        if beat.tzinfo is None:
            beat = beat.replace(tzinfo=UTC)
        return (datetime.now(UTC) - beat).total_seconds() > self.stale_after_s


def _outcome(name: str, result: Result) -> Outcome:
    if result.type == Result.Type.SUCCESSFUL and isinstance(result.return_value, dict):
        return Outcome(bool(result.return_value["ok"]), str(result.return_value["content"]))
    lines = (result.exc_string or "").strip().splitlines()
    reason = lines[-1] if lines else "failed"
    if "JobTimeoutException" in reason:
        reason = "timed out"
    return Outcome(False, f"{name} tool error: {reason}")
