"""Who holds a TCP port. `ampd up` checks every port it is about to serve on before it
starts anything, and names the process in the way where /proc lets us see it (another
user's process shows as its port alone)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could not bind ``host:port`` now (SO_REUSEADDR, as uvicorn binds:
    a connection of a server gone, in TIME_WAIT, does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on ``port``, from the kernel's TCP tables."""
    inodes = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        with contextlib.suppress(FileNotFoundError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == LISTEN:
                    inodes.add(fields[9])
    return inodes


def holder(port: int) -> str | None:
    """The process listening on ``port`` ("pid 4242: python -m http.server 8000"), or None
    where /proc does not show it."""
    sockets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    for process in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            if any(os.readlink(fd) in sockets for fd in (process / "fd").iterdir()):
                command = (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {process.name}: {command}"
    return None
