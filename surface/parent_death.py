"""A process that ends when the process that started it does (Linux's parent-death signal).

A parent killed hard - SIGKILL from a caller's deadline, an OOM kill - runs no clean-up,
and a child in a session of its own outlives it: a vLLM engine left that way kept its
port, its KV cache and a core busy-polling for NIXL with nobody left to stop it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2)


def end_with_parent(sig: signal.Signals = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel for ``sig`` when this process's parent ends. Called in the child (a
    ``preexec_fn``, or first thing in its own code); ``parent``, the pid it was started
    by, covers a parent that ended before the request was made."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
