"""The floors as contracts (pyproject.toml, [tool.importlinter]): perfmodel at the ground; the
round core, the engine surface and the tools sandbox on it; the live gateway, the offline
planner and the engines above those, none importing another; the CLI and the benchmarks on
top. The round core and the performance model do no I/O."""

from __future__ import annotations

from pathlib import Path

import pytest
from importlinter import cli

pytestmark = pytest.mark.unit


def test_every_layer_imports_only_the_layers_below_it(capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # where pyproject.toml holds the contracts
    assert cli.lint_imports(no_cache=True) == cli.EXIT_STATUS_SUCCESS, capsys.readouterr().out[-4000:]
