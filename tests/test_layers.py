"""The floors as contracts (pyproject.toml, [tool.importlinter]): perfmodel at the ground; the
round core, the engine surface and the tools sandbox on it; the live gateway, the offline
planner and the engines above those, none importing another; the CLI and the benchmarks on
top. The round core and the performance model do no I/O."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_layer_imports_only_the_layers_below_it():
    # In a process of its own: import-linter's command line configures logging for the
    # whole process, silencing every logger that exists (the tests' own included).
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
