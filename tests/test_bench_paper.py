"""`ampd bench paper`: deployment search, the improvement maths, and the command's reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.paper import (
    BASELINES,
    OURS,
    POLICIES,
    SENSITIVITY,
    Cell,
    colocated_candidates,
    disaggregated_candidates,
    improvement,
    run_trace,
    winners,
)
from bench.sweep import SweepPoint
from planner.plan import ProfileBook


@pytest.mark.unit
def test_baselines_search_every_deployment_that_fills_the_cluster():
    book = ProfileBook("llama-3.1-70b")  # fits TP 2, 4 and 8 on H20
    split = [(p.profile.tp, p.replicas, d.profile.tp, d.replicas) for p, d in disaggregated_candidates(book, "H20", 8)]
    assert sorted(split) == [(2, 1, 2, 3), (2, 2, 2, 2), (2, 2, 4, 1), (2, 3, 2, 1), (4, 1, 2, 2), (4, 1, 4, 1)]
    assert [(p.profile.tp, p.replicas) for p in colocated_candidates(book, "H20", 8)] == [(2, 4), (4, 2), (8, 1)]
    assert all(p.gpus + d.gpus == 32 for p, d in disaggregated_candidates(book, "H20", 32))


def _point(workload: str, rate: float, policy: str, attainment: float) -> SweepPoint:
    return SweepPoint(workload, rate, policy, "-", 8, "mean", attainment, None, None, None, 0.0, None, None, None,
                      None, None)  # fmt: skip


@pytest.mark.unit
def test_improvement_is_relative_and_leaves_out_baselines_at_zero():
    points = [
        _point("toolbench", 1.0, "ampd", 0.9),
        _point("toolbench", 1.0, "coloc", 0.6),  # +50%
        _point("toolbench", 2.0, "ampd", 0.5),
        _point("toolbench", 2.0, "coloc", 0.25),  # +100%
        _point("toolbench", 3.0, "ampd", 0.2),
        _point("toolbench", 3.0, "coloc", 0.0),  # no ratio
        _point("toolbench", 1.0, "disagg", 0.95),  # ampd worse: -5.26%
    ]
    coloc = improvement(points, "coloc")
    assert coloc.average == pytest.approx(0.75) and coloc.maximum == pytest.approx(1.0)
    assert (coloc.points, coloc.baseline_zero) == (2, 1)
    disagg = improvement(points, "disagg")
    assert disagg.average == pytest.approx(0.9 / 0.95 - 1) and disagg.points == 1
    assert improvement(points, "continuum").average is None


@pytest.mark.unit
def test_winners_are_every_policy_at_the_top():
    points = [_point("toolbench", 1.0, "ampd", 0.9), _point("toolbench", 1.0, "coloc", 0.9),
              _point("toolbench", 1.0, "disagg", 0.5), _point("hotpotqa", 1.0, "disagg", 0.7)]  # fmt: skip
    assert winners(points) == {("toolbench", 1.0): ["ampd", "coloc"], ("hotpotqa", 1.0): ["disagg"]}


@pytest.mark.unit
def test_each_policy_runs_on_its_best_deployment_in_every_cell():
    book = ProfileBook("llama-3.1-8b")
    cells = [Cell("mean", 5.0), Cell("p95", 5.0), Cell("p95", 2.0)]
    points = run_trace(book, "H100", "toolbench", [0.5], sessions=20, cells=cells, seed=0)
    assert len(points) == len(cells) * len(POLICIES)
    for cell in cells:
        by = {p.policy: p for p in points if (p.itl_rule, p.slo_scale) == (cell.rule, cell.scale)}
        assert list(by) == list(POLICIES)
        assert by["coloc"].deployment.startswith("D ") and by["coloc"].local_share_incremental == 1.0
        assert by["disagg"].deployment.startswith("P ") and by["disagg"].local_share_incremental == 0.0
        assert all(p.gpus == 8 for p in by.values())  # every deployment fills the cluster
    # Under the mean rule ampd-tail is ampd, decision for decision.
    mean = {p.policy: p for p in points if p.itl_rule == "mean"}
    assert (mean["ampd-tail"].slo_attainment_rounds, mean["ampd-tail"].deployment) == (
        mean["ampd"].slo_attainment_rounds, mean["ampd"].deployment)  # fmt: skip


def test_the_command_writes_the_grid_and_sensitivity(tmp_path):
    command = [sys.executable, "-m", "ampd.cli", "bench", "paper", "--workloads", "toolbench", "--rates",
               "toolbench=0.3,0.6", "--scales", "2,5", "--model", "llama-3.1-8b", "--gpu", "H100", "--sessions", "15",
               "--sensitivity-rate", "0.5", "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "paper.json").read_text())
    assert [(c["rule"], c["scale"]) for c in data["cells"]] == [
        ("mean", 2.0),
        ("mean", 5.0),
        ("p95", 2.0),
        ("p95", 5.0),
    ]
    for cell in data["cells"]:
        assert len(cell["points"]) == 2 * len(POLICIES) and len(cell["winners"]) == 2
        assert {(i["policy"], i["baseline"]) for i in cell["improvements"]} == {(o, b) for o in OURS for b in BASELINES}
    assert len(data["sensitivity"]["points"]) == sum(len(v) for v in SENSITIVITY.values())
    assert data["slos"][0]["ttft_s"] > 0 and data["wall_s"] > 0
    report = (tmp_path / "paper.md").read_text()
    assert "## Summary" in report and "## p95 ITL, SLO scale 2" in report and "### toolbench, 8 GPUs" in report
    assert "Sensitivity" in report
    for png in ("attainment_mean_x2", "breakdown_p95_x5", "sensitivity"):
        assert (tmp_path / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad, message in ((["--workloads", "nope"], "unknown workloads"), (["--rates", "nope=1"], "bad --rates"),
                         (["--rules", "p99"], "bad --rules")):  # fmt: skip
        wrong = subprocess.run([*command[:5], *bad], capture_output=True, text=True, timeout=60)
        assert wrong.returncode != 0 and message in wrong.stdout + wrong.stderr


def test_the_sensitivity_sweep_sets_each_verdict_beside_the_efficiency(tmp_path):
    """`ampd bench sensitivity`: the grid at one point, the profiles derived at two GEMM
    efficiencies; each published verdict's two sides at each, and each cell's winners."""
    command = [sys.executable, "-m", "ampd.cli", "bench", "sensitivity", "--points", "toolbench=0.6",
               "--efficiencies", "0.45,0.75", "--rules", "p95", "--scales", "3", "--model", "llama-3.1-8b",
               "--gpu", "H100", "--sessions", "15", "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = json.loads((tmp_path / "sensitivity.json").read_text())["verdicts"]
    assert [(v["efficiency"], v["rule"], v["scale"]) for v in verdicts] == [(0.45, "p95", 3.0), (0.75, "p95", 3.0)]
    for v in verdicts:
        assert set(v["attainment"]) == set(POLICIES) and v["best_attainment"] == max(v["attainment"].values())
        assert set(v["winners"]) == {p for p, a in v["attainment"].items() if a == v["best_attainment"]}
    faster = {p: b - a for p, a, b in zip(verdicts[0]["attainment"], verdicts[0]["attainment"].values(),
                                          verdicts[1]["attainment"].values(), strict=True)}  # fmt: skip
    assert sum(faster.values()) >= 0  # cheaper prefill serves the same trace no worse overall
    report = (tmp_path / "sensitivity.md").read_text()
    assert "| toolbench | 0.6 | p95, x3 | ampd vs disagg | 0.45: " in report and "## Each cell's winners" in report
    wrong = subprocess.run([*command[:5], "--efficiencies", "1.5"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "fractions of peak" in wrong.stdout + wrong.stderr
