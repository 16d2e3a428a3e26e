"""Every `ampd bench` command runs in the suite: here, those no other module runs, through the
CLI, each at the smallest size that still runs every arm, in seconds (GPU-free engines or the
simulator), checking the JSON each writes. The rest are run by their own modules (the first
test below holds the whole list to that); the vLLM ones (fidelity, stepsize) by theirs.

A peer that a bench compares with (LiteLLM, vllm-router) runs only from a venv that is already
there (`python -m bench.peer_venvs PEER`, which `make test` runs for the peers it needs): a
test installs nothing, and says so when it skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampd.local_redis import free_port

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = "redis://127.0.0.1:6379/13"
AMPD = [sys.executable, "-m", "ampd.cli"]
# Commands a test runs through the bench function the CLI calls, with the CLI's arguments.
BY_FUNCTION = {"load": "run_load_bench(", "chaos": "run_chaos_bench("}


def _run(command: list[str], cwd: Path, timeout: float = 120, **env: str) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.unit
def test_every_bench_command_is_run_by_a_test():
    """A test runs each `ampd bench` command, through the CLI or its bench function: a command
    added without one fails here."""
    from bench.commands import bench_app

    names = [c.name or c.callback.__name__.replace("_", "-") for c in bench_app.registered_commands]
    assert len(names) >= 20
    texts = [p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))]
    missing = [n for n in names if not any(f'"bench", "{n}"' in t or BY_FUNCTION.get(n, "\0") in t for t in texts)]
    assert missing == [], f"no test runs `ampd bench {' / '.join(missing)}`"


def test_engine_finds_the_streams_one_worker_core_sustains(tmp_path):
    """Doubling the streams until the ITL leaves the tolerance, then bisecting: every level in
    the order the search took it, and the answer the last passing level below the first miss."""
    out = tmp_path / "engine.json"
    _run([*AMPD, "bench", "engine", "--speed", "2", "--output-tokens", "16", "--port", str(free_port()),
          "--out", str(out)], tmp_path)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["profile"] == "llama-3.1-8b_h100_tp1" and report["output_tokens"] == 16
    levels, tolerance = report["levels"], report["tolerance"]
    for level in levels:
        assert level["predicted_itl_ms"] > 0 and level["measured_itl_ms"] > 0 and level["p99_stream_itl_ms"] > 0
        assert level["excess"] == pytest.approx(level["measured_itl_ms"] / level["predicted_itl_ms"] - 1)
    taken = iter(levels)
    n, good, bad = 1, 0, 0
    while n <= 4096:
        level = next(taken)
        assert level["streams"] == n, levels
        if level["excess"] > tolerance:
            bad = n
            break
        good, n = n, n * 2
    while bad and bad - good > max(1, good // 8):
        level, mid = next(taken), (good + bad) // 2
        assert level["streams"] == mid, levels
        good, bad = (mid, bad) if level["excess"] <= tolerance else (good, mid)
    assert next(taken, None) is None and report["sustained_streams"] == good


def test_gateway_puts_the_gateways_latency_beside_the_workers(tmp_path):
    out = tmp_path / "gateway.json"
    _run([*AMPD, "bench", "gateway", "--levels", "1,4", "--requests", "2", "--output-tokens", "4", "--out", str(out)],
         tmp_path, REDIS_URL=REDIS_URL)  # fmt: skip
    report = json.loads(out.read_text())
    assert [x["streams"] for x in report["levels"]] == [1, 4]
    for x in report["levels"]:
        for side in ("direct", "gateway"):
            assert 0 < x[f"{side}_ttft_p50_ms"] <= x[f"{side}_ttft_p99_ms"] < 10_000, x
            assert x[f"{side}_e2e_p50_ms"] >= x[f"{side}_ttft_p50_ms"], x
        assert x["added_p50_ms"] == pytest.approx(x["gateway_ttft_p50_ms"] - x["direct_ttft_p50_ms"])
    # The decision timed alone, and as the gateway timed its own during the run (so it routed).
    assert 0 < report["decision_us_isolated"] < 10_000 and 0 < report["decision_us_live_mean"] < 100_000


def test_simulate_times_the_simulator_on_a_trace(tmp_path):
    out = tmp_path / "simulate.json"
    _run([*AMPD, "bench", "simulate", "--sessions", "40", "--rate", "0.5", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert (report["sessions"], report["rate"]) == (40, 0.5)
    sim = report["report"]
    assert sim["sessions"] == 40 and sim["rounds"] >= 40 and sim["gpus"] == 8 and sim["policy"] == "ampd"
    assert sim["makespan_s"] > 40 / 0.5 / 2 and sim["wall_s"] > 0  # the arrivals alone span about 80 s
    assert 0 <= sim["slo_attainment_rounds"] <= 1


def test_ilp_matches_the_brute_force_at_every_size(tmp_path):
    out = tmp_path / "ilp.json"
    _run([*AMPD, "bench", "ilp", "--repeats", "1", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["repeats"] == 1 and [r["gpus"] for r in rows] == [8, 16, 32, 64, 128, 256]
    for r in rows:
        assert r["matches_brute_force"], r
        assert 0 < r["first_solve_s"] <= r["top3_s"] < report["target_s"] and r["brute_force_s"] >= 0
        assert r["options"] > 0 and r["variables"] >= r["options"] and r["best"].startswith("P TP"), r


def test_kv_index_ingests_looks_up_and_weighs_its_blocks(tmp_path):
    """500 steps of 4 blocks into a cache of 1,000 (full after 250 steps: each later step evicts
    4); a 2,048-token prompt whose first half every engine holds."""
    out = tmp_path / "kv.json"
    _run([*AMPD, "bench", "kv-index", "--batches", "500", "--blocks-per-store", "4", "--capacity-blocks", "1000",
          "--prompt-tokens", "2048", "--engines", "4", "--repeats", "5", "--out", str(out)], tmp_path)  # fmt: skip
    report = json.loads(out.read_text())
    ingest, lookup = report["ingest"], report["lookup"]
    assert ingest["events"] == 500 + (500 * 4 - 1000)  # a store per step, a removal per evicted block
    assert ingest["cpu_s"] > 0 and ingest["events_per_s_per_core"] == pytest.approx(1500 / ingest["cpu_s"])
    full_blocks = (2048 - 1) // report["block_size"]  # the last token is never part of a cached block
    assert lookup["cached_tokens_found"] == full_blocks // 2 * report["block_size"]
    assert 0 < lookup["median_ms"] <= lookup["p95_ms"] < 1000 and lookup["repeats"] == 5
    assert 8 < report["memory"]["bytes_per_block"] < 10_000 and report["memory"]["blocks"] == 1000


def test_placement_finds_the_knee_and_runs_every_rule_on_every_seed(tmp_path):
    from rounds.placement import PLACEMENTS

    out = tmp_path / "placement" / "placement.json"
    _run([*AMPD, "bench", "placement", "--rates", "0.3,0.6", "--rules", "mean,p95", "--profile",
          "llama-3.1-8b_h100_tp1", "--prefill", "1", "--decode", "2", "--agents", "2", "--tenants", "1",
          "--sessions", "30", "--seeds", "0,1", "--out", str(out)], tmp_path)  # fmt: skip
    report = json.loads(out.read_text())
    setup, rows = report["setup"], report["rows"]
    assert setup["rate"] in (0.3, 0.6) and setup["seeds"] == [0, 1] and setup["gpus"] == 3
    assert sorted((r["placement"], r["itl_rule"], r["seed"]) for r in rows) == sorted(
        (p, rule, s) for p in PLACEMENTS for rule in ("mean", "p95") for s in (0, 1))  # fmt: skip
    assert all(0 <= r["attainment"] <= 1 and r["prefill_tokens"] > 0 for r in rows)
    tokens = {(r["placement"], r["seed"]): r["prefill_tokens"] for r in rows}
    assert all(tokens[("ampd", s)] < tokens[("memory", s)] for s in (0, 1)), tokens  # the caches save prefill
    assert len(report["summary"]) == 2 * len(PLACEMENTS) and all(s["seeds"] == 2 for s in report["summary"])
    assert (out.with_suffix(".md")).read_text().count("\n| ") == 2 + 2 * len(PLACEMENTS)


@pytest.mark.parametrize("peer", ["litellm", "vllm-router"])
def test_overhead_runs_a_peer_beside_ampd(peer, tmp_path, monkeypatch):
    """`ampd bench overhead`'s peer arms (its own arms are tests/test_bench_overhead.py's), each
    from the venv bench/venvs/ holds."""
    from bench.peer_venvs import VENVS, installed

    monkeypatch.chdir(ROOT)  # the bench finds the peers' venvs from the repository's root
    if not installed(peer):
        pytest.skip(f"{peer} is not installed in {VENVS / peer} and a test installs nothing "
                    f"(`python -m bench.peer_venvs {peer}` installs it)")  # fmt: skip
    out = tmp_path / "overhead.json"
    _run([*AMPD, "bench", "overhead", "--arms", f"direct,ampd,{peer}", "--levels", "2", "--requests", "2",
          "--output-tokens", "8", "--out", str(out)], ROOT, REDIS_URL=REDIS_URL)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["failures"] == {}
    levels = {x["arm"]: x for x in report["levels"]}
    assert list(levels) == ["direct", "ampd", peer] and all(x["requests"] == 4 for x in levels.values())
    # Every token came through the peer as it came directly (8 tokens, and role and usage events).
    assert levels[peer]["events_per_request"] == levels["direct"]["events_per_request"] >= 8
    assert 0 < levels[peer]["cpu_ms_per_request"] < 1000 and levels[peer]["request_rate"] > 0
    (row,) = [r for r in report["overheads"] if r["arm"] == peer]
    assert row["streams"] == 2 and row["rate_vs_ampd"] > 0
    assert f"| 2 | {peer} |" in out.with_suffix(".md").read_text()
