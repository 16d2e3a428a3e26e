"""Engines under test as real processes, and readers for what they serve."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ampd.local_redis import free_port
from ampd.processes import Child, spawn_gateway, spawn_sim_worker, spawn_tools_worker, tools_worker_ready, wait_healthy
from surface.wire import cache_config

# A read's limit, not a wait: a niced vLLM API server on a loaded two-core machine has
# taken over 10 s to answer /metrics in CI while its engines' NIXL threads spin.
METRICS_TIMEOUT_S = 60.0


@dataclass
class Engine:
    """An engine under test, reached only over HTTP (a GPU-free worker or vLLM)."""

    url: str
    model: str
    child: Child | None = None
    kind: str = "sim"  # or "vllm": where the two differ on purpose, tests say so

    @property
    def block_size(self) -> int:
        found = cache_config(httpx.get(f"{self.url}/metrics", timeout=METRICS_TIMEOUT_S).text)
        assert found is not None, "the engine exports no vllm:cache_config_info"
        return found[1]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name plus sorted labels (model/engine dropped)."""
        out: dict[str, float] = {}
        text = httpx.get(f"{self.url}/metrics", timeout=METRICS_TIMEOUT_S).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
                key = sample.name + ("" if not labels else json.dumps(labels, sort_keys=True))
                out[key] = sample.value
        return out

    def metrics_once(self, recorded: Callable[[dict[str, float]], bool], timeout_s: float = 60.0) -> dict[str, float]:
        """/metrics once they show what a test just did: vLLM publishes a request's
        stats - its KV transfers' most of all - a moment after answering it. Returns the
        last read at the deadline, for the test's assertions to report."""
        deadline = time.monotonic() + timeout_s
        metrics = self.metrics()
        while not recorded(metrics) and time.monotonic() < deadline:
            time.sleep(0.05)
            metrics = self.metrics()
        return metrics


def start_sim_worker(tmp: Path, *options: str, timeout_s: float = 30.0) -> Engine:
    port = free_port()
    log = tmp / f"worker-{port}.log"
    child = spawn_sim_worker("sim worker", port, options, log=log)
    if wait_healthy([child], timeout_s) is not None:
        child.stop()
        raise RuntimeError(f"worker did not become healthy: {log.read_text()}")
    model = httpx.get(f"{child.url}/v1/models").json()["data"][0]["id"]
    return Engine(child.url, model, child)


def stop(engine: Engine) -> None:
    if engine.child is not None:
        engine.child.stop()


def sse_events(response: httpx.Response) -> list[dict | str]:
    """Parse a text/event-stream body into JSON payloads ('[DONE]' kept as a string)."""
    out: list[dict | str] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def session_rounds(url: str, session_id: str, count: int, headers: dict[str, str] | None = None) -> list[dict]:
    """A session's round records from ``GET /v1/sessions/{id}`` once ``count`` are there (a
    deadline, not a sleep: a round is recorded as its stream ends)."""
    deadline, rounds = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        response = httpx.get(f"{url}/v1/sessions/{session_id}", headers=headers or {}, timeout=30)
        rounds = response.json().get("rounds", []) if response.status_code == 200 else []
        if len(rounds) >= count:
            return rounds
        time.sleep(0.05)
    raise AssertionError(f"session {session_id} has {len(rounds)} rounds, not {count}")


def start_gateway(tmp: Path, redis_url: str, prefix: str, *options: str, timeout_s: float = 30.0) -> Child:
    """A gateway on a free port, ready once it sees at least one decode worker."""
    port = free_port()
    log = tmp / f"gateway-{port}.log"
    child = spawn_gateway("gateway", port, ["--redis-url", redis_url, "--redis-prefix", prefix, *options], log=log)
    if wait_healthy([child], timeout_s, path="/readyz") is not None:
        child.stop()
        raise RuntimeError(f"gateway did not become ready: {log.read_text()}")
    return child


def start_tools_worker(tmp: Path, redis_url: str, prefix: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """An `ampd tools-worker` in its own process group (so a test can kill it, horses and all)."""
    log = tmp / f"tools-{prefix}-{time.monotonic_ns()}.log"
    process = spawn_tools_worker(redis_url, prefix, log, env)
    if not tools_worker_ready(redis_url, prefix, process):
        kill_group(process)
        raise RuntimeError(f"tools worker did not start: {log.read_text()}")
    return process


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` (started with ``start_new_session``) and everything in its session:
    rq's work horses move to process groups of their own, and would otherwise finish their
    job - writing to Redis - after the test has moved on."""
    for pid in [int(d) for d in os.listdir("/proc") if d.isdigit()]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getsid(pid) == process.pid:
                os.kill(pid, signal.SIGKILL)
    process.wait(timeout=10)


def process_running(pid: int) -> bool:
    """Alive and not a zombie (one that ended, waiting for whoever adopted it to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
