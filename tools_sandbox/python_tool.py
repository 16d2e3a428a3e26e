"""The ``python`` tool: run a model's code in a sandboxed subprocess.

Containment, outermost first:

* namespaces (``unshare``, when this process may create them - root, or a container
  with CAP_SYS_ADMIN): an empty network namespace (no interfaces up, so no network at
  all), a PID namespace (no other process is visible or signalable) and a mount
  namespace in which everything but the scratch directory is read-only and /tmp is a
  throwaway tmpfs (tools_sandbox.jail);
* the unprivileged ``nobody`` user (same condition);
* resource limits: CPU seconds, address space, processes, file size, open files, no
  core dumps; a wall-clock timeout on the whole process group;
* a fresh scratch directory as the working directory, deleted afterwards, and a
  scrubbed environment (nothing of the worker's or the gateway's leaks in);
* caps on captured stdout and stderr: the process is killed when it exceeds them.

``isolation()`` reports which of these are in force on this machine; without
namespace support only the limits, scratch directory and scrubbed environment hold.
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools_sandbox.outcome import Outcome

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Scratch directories live outside /tmp, which the jail replaces with a private tmpfs.
SCRATCH_ROOT = Path(os.environ.get("AMPD_SANDBOX_DIR", "/var/tmp/ampd-sandbox"))


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    output_bytes: int = 64 * 1024


@dataclass(frozen=True)
class Isolation:
    namespaces: bool
    interpreter: str

    def describe(self) -> str:
        if self.namespaces:
            return (
                "network: none (empty network namespace); processes: own PID namespace; files: read-only "
                "root, private /tmp, writable scratch only; user: nobody; plus rlimits and a scrubbed env"
            )
        return (
            "network: NOT isolated (no namespace support here); files: NOT isolated beyond the user's "
            "permissions; rlimits, wall-clock timeout, scratch directory and scrubbed env only"
        )


@functools.cache
def isolation() -> Isolation:
    """What this machine allows, checked once per process."""
    probe = ["unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "true"]
    try:
        namespaces = bool(shutil.which("unshare")) and subprocess.run(probe, capture_output=True).returncode == 0
    except OSError:
        namespaces = False
    # Dropped to nobody, the interpreter must be one nobody can run: the system's.
    system_python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    interpreter = system_python if namespaces and system_python else sys.executable
    return Isolation(namespaces, interpreter)


def run_python(code: str, limits: Limits = Limits()) -> Outcome:
    where = isolation()
    SCRATCH_ROOT.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="run-", dir=SCRATCH_ROOT)
    try:
        Path(scratch, "main.py").write_text(code)
        inner = [where.interpreter, "-I", "main.py"]
        jail = [sys.executable, "-m", "tools_sandbox.jail", scratch, "--", *inner]
        argv = ["unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", *jail]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(PROJECT_ROOT),
               "AMPD_SANDBOX_CPU_S": str(limits.cpu_s)}  # fmt: skip
        process = subprocess.Popen(
            argv if where.namespaces else jail,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        stdout, stderr, problem = _collect(process, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = stdout.decode(errors="replace")
    errors = stderr.decode(errors="replace")
    if problem is None and process.returncode != 0:
        problem = f"exited with status {process.returncode}" if process.returncode > 0 else (
            f"killed by signal {-process.returncode}")  # fmt: skip
    if problem is None:
        return Outcome(True, text)
    detail = "\n".join(part for part in (text, errors) if part.strip())
    return Outcome(False, f"python tool error: {problem}" + (f"\n{detail}" if detail else ""))


def _collect(process: subprocess.Popen, limits: Limits) -> tuple[bytes, bytes, str | None]:
    """Read both pipes up to the caps and the deadline; kill the group on a breach."""
    deadline = time.monotonic() + limits.wall_s
    buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
    problem = None
    with selectors.DefaultSelector() as selector:
        for pipe in buffers:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                problem = f"timed out after {limits.wall_s:g} s (wall clock)"
                break
            for key, _ in selector.select(timeout=remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer += chunk
                if len(buffer) > limits.output_bytes:
                    del buffer[limits.output_bytes :]
                    problem = f"output exceeded {limits.output_bytes} bytes"
            if problem:
                break
    if problem:
        _kill(process)
    try:
        process.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        _kill(process)
        process.wait()
    return bytes(buffers[process.stdout]), bytes(buffers[process.stderr]), problem


def _kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
