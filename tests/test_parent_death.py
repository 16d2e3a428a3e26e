"""A child that asked for the parent-death signal (surface.parent_death) ends when its
parent is killed hard; one that did not, in a session of its own, outlives it - what a
vLLM engine did when its supervisor was SIGKILLed by a test's teardown deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.engines import process_running

ROOT = Path(__file__).resolve().parent.parent
# A parent that starts a sleeping child in a session of its own (as the vLLM supervisor
# starts vLLM), asking for SIGTERM on its death or not, and prints the child's pid.
PARENT = """
import functools, os, signal, subprocess, sys
from surface.parent_death import end_with_parent
hook = functools.partial(end_with_parent, signal.SIGTERM, os.getpid()) if sys.argv[1] == "ask" else None
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         preexec_fn=hook)
print(child.pid, flush=True)
child.wait()
"""


def _orphan(ask: bool, wait_s: float) -> tuple[int, bool]:
    """The child's pid, and whether it was still running ``wait_s`` after its parent was
    SIGKILLed (the wait ends early if it ends)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "ask" if ask else "no"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert process_running(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + wait_s
    while process_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, process_running(child)


def test_a_child_that_asked_ends_with_its_parent():
    _, running = _orphan(ask=True, wait_s=10)
    assert not running


def test_a_child_that_did_not_ask_outlives_its_parent():
    child, running = _orphan(ask=False, wait_s=2)
    try:
        assert running
    finally:
        if running:
            os.kill(child, signal.SIGKILL)
