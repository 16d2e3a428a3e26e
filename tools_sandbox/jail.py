"""The sandbox's inside: run as root in fresh namespaces, lock down, drop to nobody, exec.

Invoked as ``unshare --net --mount --pid --fork --mount-proc python -m tools_sandbox.jail
SCRATCH -- CMD...`` by tools_sandbox.python_tool. In the new mount namespace it makes
every mount private, keeps ``SCRATCH`` writable, remounts everything else read-only,
gives ``/tmp`` and ``/dev/shm`` fresh small tmpfs instances (thrown away on exit), then
drops to the unprivileged ``nobody`` user and runs CMD under resource limits with a
scrubbed environment in SCRATCH. The network namespace has no interfaces up
(not even loopback), and the PID namespace hides every other process.
"""

from __future__ import annotations

import os
import pwd
import resource
import signal
import subprocess
import sys

LIMITS = {  # resource: (soft, hard); CPU seconds come from the caller
    resource.RLIMIT_AS: 512 * 2**20,
    resource.RLIMIT_FSIZE: 16 * 2**20,
    resource.RLIMIT_NPROC: 64,
    resource.RLIMIT_NOFILE: 64,
    resource.RLIMIT_CORE: 0,
}


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def lock_down(scratch: str) -> None:
    _mount("--make-rprivate", "/")
    _mount("--bind", scratch, scratch)  # its own mount, so it stays writable below
    _mount("-o", "remount,bind,ro", "/")
    for path in ("/tmp", "/dev/shm"):
        if os.path.isdir(path):
            _mount("-t", "tmpfs", "-o", "size=16m,nosuid,nodev", "tmpfs", path)


def drop_privileges(scratch: str) -> None:
    nobody = pwd.getpwnam("nobody")
    os.chown(scratch, nobody.pw_uid, nobody.pw_gid)
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)


def _limit(cpu_s: int) -> None:
    for limit, value in LIMITS.items():
        resource.setrlimit(limit, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))


def main(argv: list[str]) -> int:
    scratch, separator, command = argv[0], argv[1], argv[2:]
    if separator != "--" or not command:
        raise SystemExit("usage: jail SCRATCH -- CMD...")
    cpu_s = int(os.environ.get("AMPD_SANDBOX_CPU_S", "10"))
    if os.geteuid() == 0:
        lock_down(scratch)
        drop_privileges(scratch)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8", "TMPDIR": scratch}
    # The program runs as a child so that a fatal signal can be named in the output
    # (an outer `unshare --fork` would flatten it into a bare exit status).
    child = subprocess.run(command, cwd=scratch, env=env, preexec_fn=lambda: _limit(cpu_s))
    if child.returncode >= 0:
        return child.returncode
    number = -child.returncode
    if number == signal.SIGXCPU:
        sys.stderr.write(f"ampd-sandbox: CPU time limit of {cpu_s} s exceeded\n")
    else:
        sys.stderr.write(f"ampd-sandbox: killed by {signal.Signals(number).name}\n")
    return 128 + number


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
