"""`ampd bench sweep` on a small trace: every point simulated, the reports written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.sweep import sweep
from planner.plan import Judging, ProfileBook
from planner.simulator import Pool
from planner.trace import WORKLOADS


@pytest.mark.unit
def test_every_policy_runs_at_every_rate_on_its_own_deployment():
    book = ProfileBook("llama-3.1-8b", [])
    tp1 = book.get("H100", 1)
    judging = Judging(book, book.reference_slo("H100", 5.0))
    points = sweep(WORKLOADS["toolbench"], [0.5, 2.0], ["ampd", "disagg", "coloc"], (Pool(tp1, 1), Pool(tp1, 1)),
                   Pool(tp1, 2), judging, sessions=40)  # fmt: skip
    assert [(p.rate, p.policy) for p in points] == [
        (r, policy) for r in (0.5, 2.0) for policy in ("ampd", "disagg", "coloc")
    ]
    for p in points:
        assert p.gpus == 2 and 0.0 <= p.slo_attainment_rounds <= 1.0
        assert p.deployment.startswith("D ") if p.policy == "coloc" else p.deployment.startswith("P ")
    by = {(p.rate, p.policy): p for p in points}
    assert by[(0.5, "coloc")].local_share_incremental == 1.0
    assert by[(0.5, "disagg")].local_share_incremental == 0.0
    # Four times the load on the same GPUs cannot make the baselines meet more rounds.
    for policy in ("disagg", "coloc"):
        assert by[(2.0, policy)].slo_attainment_rounds <= by[(0.5, policy)].slo_attainment_rounds
    with pytest.raises(ValueError, match="unknown policies"):
        sweep(WORKLOADS["toolbench"], [1.0], ["fifo"], (Pool(tp1, 1), Pool(tp1, 1)), Pool(tp1, 2), judging, 5)


def test_the_command_writes_json_markdown_and_a_png(tmp_path):
    command = [sys.executable, "-m", "ampd.cli", "bench", "sweep", "--workload", "hotpotqa", "--rates", "0.2,0.4",
               "--policies", "ampd,coloc", "--model", "llama-3.1-8b", "--gpu", "H100", "--prefill", "1x1",
               "--decode", "1x1", "--colocated", "1x2", "--sessions", "20", "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "sweep_hotpotqa.json").read_text())
    assert len(data["points"]) == 4 and "simulated" in data["title"]
    table = (tmp_path / "sweep_hotpotqa.md").read_text()
    assert "| rate (sessions/s) | ampd | coloc |" in table and "| 0.4 |" in table
    assert (tmp_path / "sweep_hotpotqa.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([*command[:5], "--workload", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown workload" in bad.stdout + bad.stderr
