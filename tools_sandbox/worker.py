"""`ampd tools-worker`: rq workers that run server-side tool calls.

Each worker forks a work horse per job (rq's default), so a job that dies takes only
its horse with it; the tools themselves add their own sandbox (tools_sandbox.python_tool).
Workers heartbeat their running job every second so the gateway notices a dead one
quickly (tools_sandbox.client).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import redis
from rq import Queue, Worker

from tools_sandbox.client import queue_name
from tools_sandbox.python_tool import isolation
from tools_sandbox.retrieval import corpus_dir, retrieve

log = logging.getLogger(__name__)


def work(connection: redis.Redis, prefix: str) -> None:
    """One worker, in this process, until stopped; ``connection``: a client of the deployment's Redis."""
    print(f"python tool isolation: {isolation().describe()}", flush=True)
    retrieve("warm up", 1)  # build the index before forking, so every horse inherits it
    print(f"retrieve corpus: {corpus_dir()}", flush=True)
    worker = Worker([Queue(queue_name(prefix), connection=connection)], connection=connection,
                    job_monitoring_interval=1)  # fmt: skip
    worker.work(logging_level="WARNING")


def run_workers(redis_url: str, prefix: str, count: int) -> int:
    """``count`` workers as child processes, each an ``ampd tools-worker`` of its own."""
    command = [sys.executable, "-m", "ampd.cli", "tools-worker", "--redis-url", redis_url, "--redis-prefix", prefix]
    children = [subprocess.Popen(command) for _ in range(count)]
    try:
        return max(child.wait() for child in children)
    except KeyboardInterrupt:
        for child in children:
            child.terminate()
        return 0
