"""`ampd bench fidelity --engine vllm`, run small: two real vLLM engines (its CPU build) serve
a few agent sessions through the gateway under two policies, and the same rounds are
simulated with the engines' committed profile. Its worth - how close the simulator comes -
is the study's (docs/studies/fidelity.md); here, that the rows are there, in their shape,
and that live rounds were served by vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_vllm import QUICK_START, ROOT, VLLM_PYTHON, VLLM_TIMEOUT

pytestmark = VLLM_TIMEOUT
PROFILE = ROOT / "bench" / "results" / "fidelity_vllm" / "tiny-llama-cpu_measured.json"


def test_a_small_fidelity_run_puts_live_vllm_rounds_beside_simulated_ones(tmp_path):
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"vLLM's CPU build is not installed at {VLLM_PYTHON} (`make test` installs it)")
    out = tmp_path / "fidelity.json"
    command = [sys.executable, "-m", "ampd.cli", "bench", "fidelity", "--engine", "vllm", "--sessions", "2",
               "--runs", "1", "--policies", "coloc,dynaserve", "--loads", "light", "--light-rate", "1",
               "--profile", str(PROFILE), "--work-dir", str(tmp_path / "work"), "--out", str(out),
               "--vllm-options", " ".join(QUICK_START)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840,
                          env={**os.environ, "AMPD_VLLM_PYTHON": VLLM_PYTHON})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engine"] == "vllm" and report["profile"] == str(PROFILE.relative_to(ROOT))
    assert {(r["policy"], r["load"]) for r in report["runs"]} == {("coloc", "light"), ("dynaserve", "light")}
    metrics = {r["metric"] for r in report["rows"]}
    assert {"ttft_initial_p50", "ttft_initial_p95", "gap_p50", "gap_p95", "attainment_mean", "attainment_p95",
            "attainment_max"} <= metrics  # fmt: skip
    for row in report["rows"]:
        assert set(row) >= {"policy", "load", "metric", "live", "sim", "error"}, row
        if row["metric"].startswith("attainment"):
            assert 0 <= row["live"] <= 1 and 0 <= row["sim"] <= 1
            assert row["error"] == pytest.approx(row["sim"] - row["live"])
        else:
            assert row["live"] > 0 and row["sim"] > 0
            assert row["error"] == pytest.approx((row["sim"] - row["live"]) / row["live"])
    # The harness refuses a run whose rounds any engine but vLLM served; the engines' logs say they did.
    logs = (tmp_path / "work" / "vllm-1.log").read_text()
    assert "POST /v1/chat/completions" in logs
    # Under dynaserve's P95 rule the gateway handed both engines their step target, and each took it.
    for core in (0, 1):
        assert "step target" in (tmp_path / "work" / f"vllm-{core}.log").read_text()
    # The report's live runs simulated again from their saved traces give the same rows.
    again = tmp_path / "again.json"
    done = subprocess.run([sys.executable, "-m", "ampd.cli", "bench", "fidelity", "--resimulate", str(out),
                           "--out", str(again)], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(again.read_text())["rows"] == report["rows"]
