"""Child processes the CLI and the tests start (sim workers, gateways, tools workers), and waiting for them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from rq import Queue, Worker

from surface.redis_address import RedisAddress
from tools_sandbox.client import queue_name


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


def ampd_argv(*command: str) -> list[str]:
    """The command line of ``ampd *command`` in this interpreter."""
    return [sys.executable, "-m", "ampd.cli", *command]


def spawn(
    name: str,
    port: int,
    command: Sequence[str],
    log: Path | None = None,
    cpu: int | None = None,
    env: dict[str, str] | None = None,
    niceness: int = 0,
) -> Child:
    """`ampd *command` (which must serve HTTP on ``port``) in a child process, pinned to
    ``cpu`` if given, ``niceness`` lower in priority, its output appended to ``log``,
    with ``env`` added to ours."""
    output = log.open("ab") if log is not None else subprocess.DEVNULL

    def prepare() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        os.nice(niceness)

    argv = ampd_argv(*command)
    environment = {**os.environ, **env} if env else None
    hook = prepare if cpu is not None or niceness else None
    process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, preexec_fn=hook, env=environment)
    return Child(name, f"http://127.0.0.1:{port}", process)


def spawn_sim_worker(
    name: str, port: int, options: Sequence[str] = (), log: Path | None = None, cpu: int | None = None
) -> Child:
    return spawn(name, port, ["worker", "sim", "--port", str(port), *options], log, cpu)


def spawn_gateway(name: str, port: int, options: Sequence[str] = (), log: Path | None = None) -> Child:
    """`ampd gateway` on ``port``. With a ``log``, its access log lies beside it
    (``NAME.access.log``) unless ``options`` name one: not in the caller's directory."""
    access = ["--access-log", str(log.with_suffix(".access.log"))] if log and "--access-log" not in options else []
    return spawn(name, port, ["gateway", "--port", str(port), *access, *options], log)


def spawn_tools_worker(redis_url: str, prefix: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`ampd tools-worker` in its own process group, so stopping it takes its work horses too."""
    return subprocess.Popen(
        [sys.executable, "-m", "ampd.cli", "tools-worker", "--redis-url", redis_url, "--redis-prefix", prefix],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def tools_worker_ready(redis_url: str, prefix: str, process: subprocess.Popen, timeout_s: float = 30.0) -> bool:
    """A tools worker is up once rq lists it as a worker of its queue."""
    connection = RedisAddress.parse(redis_url).client()
    queue = Queue(queue_name(prefix), connection=connection)
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        if Worker.count(queue=queue):
            return True
        time.sleep(0.1)
    return False


def wait_healthy(children: Sequence[Child], timeout_s: float = 60.0, path: str = "/health") -> Child | None:
    """None when all answer ``path`` with 200; else the first child that died or never did."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        child = pending[0]
        if child.process.poll() is not None:
            return child
        try:
            if httpx.get(f"{child.url}{path}", timeout=1.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return child
        time.sleep(0.1)
    return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live process it started, theirs included (a gateway of several
    processes: uvicorn's parent and its workers)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            for child in (task / "children").read_text().split():
                out += process_tree(int(child))
    return out


def tree_total(pid: int, of_one: Callable[[int], float]) -> float:
    """``of_one`` (a reading of /proc) added up over ``pid``'s process tree; a process that
    ends meanwhile no longer counts."""
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += of_one(member)
    return total
