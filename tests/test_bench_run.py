"""`ampd bench run`: a trace replayed live through the gateway and GPU-free workers, and simulated."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ampd.local_redis import free_port
from bench.replay import LiveRound, with_gateway_tails
from planner.trace import WORKLOADS, generate, respace, write_trace

REDIS_URL = "redis://127.0.0.1:6379/13"


def test_respace_keeps_the_sessions_and_changes_only_arrivals():
    trace = generate(WORKLOADS["toolbench"], 400, rate=0.5, seed=1)
    faster = respace(trace, rate=4.0, seed=2)
    assert [s.rounds for s in faster] == [s.rounds for s in trace]
    arrivals = [s.arrival_s for s in faster]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert 1 / 4.0 * 0.85 < arrivals[-1] / len(arrivals) < 1 / 4.0 * 1.15  # Poisson at 4/s
    with pytest.raises(ValueError):
        respace(trace, 0.0)


def _run(*options: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ampd.cli", "bench", "run", "--profile", "llama-3.1-8b_h100_tp1",
               "--speed", "10", "--port", str(free_port()), "--redis-url", REDIS_URL, *options]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.unit
def test_live_tails_are_the_gateways_per_token_gaps_where_it_recorded_the_round():
    seen = [LiveRound("s", 0, 0.3, 0.05, 0.5, 0.9, 40), LiveRound("s", 1, 0.3, 0.05, 0.5, 0.9, 40)]
    judged = with_gateway_tails(seen, {("s", 0): (0.06, 0.2)})
    assert [(r.p95_itl_s, r.max_itl_s) for r in judged] == [(0.06, 0.2), (0.5, 0.9)]
    assert judged[0].itl("p95") == 0.06 and judged[0].mean_itl_s == 0.05


def test_a_trace_file_replays_live_and_in_the_simulator(tmp_path):
    trace = generate(WORKLOADS["hotpotqa"], 4, rate=1.0, seed=3)
    write_trace(trace, tmp_path / "t.jsonl")
    done = _run("--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "run.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "run.json").read_text())
    rounds = sum(len(s.rounds) for s in trace)
    # Every round of every session ran live, through the gateway, and in the simulator.
    assert result["live"]["rounds"] == result["simulated"]["rounds"] == rounds == 12
    assert result["trace"] == str(tmp_path / "t.jsonl") and result["policy"] == "ampd"
    for side in ("live", "simulated"):
        assert 0 < result[side]["ttft_mean_s"] <= result[side]["ttft_p95_s"]
        assert 0.0 <= result[side]["slo_attainment_rounds"] <= 1.0
    assert result["within_bar"] == (abs(result["attainment_points"]) <= 5 and abs(result["p95_ttft_rel"]) <= 0.10)


def test_a_colocated_policy_runs_without_prefill_workers(tmp_path):
    done = _run("--workload", "toolbench", "--sessions", "3", "--rate", "2", "--policy", "coloc",
                "--prefill-replicas", "0", "--out", str(tmp_path / "coloc.json"))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "coloc.json").read_text())
    assert result["simulated"]["local_share_incremental"] == 1.0 and result["live"]["rounds"] > 0
    wrong = _run("--policy", "coloc", "--prefill-replicas", "1", timeout=60)
    assert wrong.returncode == 2 and "--prefill-replicas 0" in wrong.stdout
    missing = _run("--trace", str(tmp_path / "none.jsonl"), timeout=60)
    assert missing.returncode == 2 and "none.jsonl" in missing.stdout.replace("\n", "")  # rich wraps a long path
