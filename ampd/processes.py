"""Child processes the CLI and the tests start: sim workers, and waiting for them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Child:
    name: str
    url: str
    process: subprocess.Popen

    def stop(self, timeout_s: float = 10.0) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()


def spawn_sim_worker(
    name: str, port: int, options: Sequence[str] = (), log: Path | None = None, cpu: int | None = None
) -> Child:
    """`ampd worker sim --port PORT *options` in a child process (pinned to ``cpu`` if given)."""
    command = [sys.executable, "-m", "ampd.cli", "worker", "sim", "--port", str(port), *options]
    output = log.open("ab") if log is not None else subprocess.DEVNULL
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, preexec_fn=pin)
    return Child(name, f"http://127.0.0.1:{port}", process)


def wait_healthy(children: Sequence[Child], timeout_s: float = 60.0) -> Child | None:
    """None when all answer /health; else the first child that died or never answered."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        child = pending[0]
        if child.process.poll() is not None:
            return child
        try:
            if httpx.get(f"{child.url}/health", timeout=1.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return child
        time.sleep(0.1)
    return None
