"""ampd's gateway from two source trees in one `ampd bench overhead` run, beside vllm-router.

A one-off harness, not part of the package: the overhead bench's ratios move by a fifth
from one run to the next on a shared 2-core machine, so a change to the request path is
judged by gateways of both trees measured in the same run. Arms: ``ampd`` (this tree, as
shipped), ``ampd-x1`` (the tree at ``$OLD``, a checkout of an earlier commit: `git
worktree add /tmp/old <commit>`, started there with its own modules first on the path),
``ampd-x2`` (this tree with its access log off), ``vllm-router``.

    OLD=/tmp/old .venv/bin/python -m bench.studies.overhead_hot_path.two_trees 64,256 out.json
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

import bench.overhead as overhead
from ampd import processes

OLD = os.environ["OLD"]
_shipped = overhead.spawn_gateway


def spawn_gateway(name: str, port: int, options=(), log: Path | None = None) -> processes.Child:
    options = ["1" if option == "2" else option for option in options]  # every arm one process
    if name == "ampd-x1":  # the old tree: its own CLI, which may not know the access log's option
        argv = processes.ampd_argv("gateway", "--port", str(port), *options)
        output = log.open("ab") if log is not None else subprocess.DEVNULL
        child = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, cwd=OLD,
                                 env={**os.environ, "PYTHONPATH": OLD})  # fmt: skip
        return processes.Child(name, f"http://127.0.0.1:{port}", child)
    if name == "ampd-x2":
        return _shipped(name, port, [*options, "--access-log", "off"], log)
    return _shipped(name, port, options, log)


def main() -> int:
    overhead.spawn_gateway = spawn_gateway
    levels = [int(x) for x in sys.argv[1].split(",")]
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    arms = ["ampd", "ampd-x1", "ampd-x2", "vllm-router"]
    return overhead.run_overhead_bench(Console(width=200), arms, levels, 5, 32, 0, out)


if __name__ == "__main__":
    sys.exit(main())
