"""`ampd bench elastic`: shaped traces, every policy's best fixed deployment against elastic roles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.elastic import POLICY_ORDER, required


@pytest.mark.unit
def test_the_goal_asks_the_lesser_of_1_3x_and_half_the_shortfall():
    assert required(0.5) == pytest.approx(0.65)  # 1.3x asks less than 75%
    assert required(0.8) == pytest.approx(0.9)  # half the shortfall asks less than 104%
    assert required(1.0) == pytest.approx(1.0)


def test_the_command_writes_verdicts_outcomes_and_roles_over_time(tmp_path):
    command = [sys.executable, "-m", "ampd.cli", "bench", "elastic", "--traces", "short=toolbench:burst:0.3:1.2:180",
               "--rules", "mean,p95", "--model", "llama-3.1-8b", "--gpu", "H100", "--gpus", "4",
               "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "elastic.json").read_text())
    assert [(v["trace"], v["rule"]) for v in data["verdicts"]] == [("short", "mean"), ("short", "p95")]
    for verdict in data["verdicts"]:
        assert verdict["complete"]  # every elastic run finished every round
        best = verdict["best_fixed"]["slo_attainment_rounds"]
        mine = [o for o in data["outcomes"] if o["rule"] == verdict["rule"]]
        assert {o["policy"] for o in mine} == set(POLICY_ORDER)
        assert best == max(o["slo_attainment_rounds"] for o in mine if not o["policy"].startswith("elastic"))
        assert verdict["met"] == (verdict["elastic"]["slo_attainment_rounds"] >= required(best))
        # No static split of the pools beats the switching bound: it takes their best minute by minute.
        assert verdict["switching_bound"] >= verdict["best_split"] > 0
    roles = data["timelines"]["short"]["roles"]
    assert set(roles) == {"mean", "p95"} and all(steps[0][0] == 0.0 for steps in roles.values())
    assert "## Goal" in (tmp_path / "elastic.md").read_text()
    assert (tmp_path / "roles_short.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad, message in ((["--traces", "x=nope:ramp:1:2:60"], "bad --traces"), (["--rules", "p99"], "bad --rules")):
        wrong = subprocess.run([*command[:5], *bad], capture_output=True, text=True, timeout=60)
        assert wrong.returncode != 0 and message in wrong.stdout + wrong.stderr
