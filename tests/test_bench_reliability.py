"""`ampd bench load` and `ampd bench chaos`, run short: their checks must hold on a healthy
system, and their reports must say what they measured."""

from __future__ import annotations

import json

from rich.console import Console

from bench.chaos import FAULTS, run_chaos_bench
from bench.load import LoadShape, run_load_bench

REDIS_URL = "redis://127.0.0.1:6379/13"


def test_a_short_load_run_loses_no_round_and_reports_memory_and_added_latency(tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_URL", REDIS_URL)
    out = tmp_path / "load.json"
    shape = LoadShape(rounds=3, output_tokens=8, think_s=(0.2, 0.6))
    code = run_load_bench(Console(file=(tmp_path / "console.txt").open("w")), 40, 0.4, 0.2, 10.0, "coloc", shape, out)
    report = json.loads(out.read_text())
    direct, gateway = report["arms"]
    # What the bench's verdict (its exit code) rests on, one by one, so a failure names its cause.
    assert gateway["errors"] == {} and direct["errors"] == {}, (gateway["errors"], direct["errors"])
    assert gateway["lost_rounds"] == gateway["duplicated_rounds"] == gateway["unverified_sessions"] == 0, gateway
    assert report["gateway_requests_counted"].get("200") == gateway["rounds_ok"], report["gateway_requests_counted"]
    assert code == 0
    assert gateway["rounds_ok"] > 100
    rss = report["gateway_rss_mib"]
    assert 20 < rss["start"] <= rss["max"] and rss["end"] <= rss["max"]
    assert report["added_ttft_p99_ms"] == gateway["ttft_p99_ms"] - direct["ttft_p99_ms"]
    # Minute by minute: every round counted once, the gateway's CPU and its wait for one read off /proc.
    assert sum(m["rounds"] for m in gateway["by_minute"]) == gateway["rounds_ok"]
    assert sum(m["rounds"] for m in direct["by_minute"]) == direct["rounds_ok"]
    assert all(m["ttft_p50_ms"] <= m["ttft_p99_ms"] for m in gateway["by_minute"])
    assert gateway["by_minute"][0]["cpu_ms_per_round"] > 0
    assert gateway["by_minute"][0]["cpu_wait_ms_per_round"] >= 0
    # At full load: the rounds sent after the ramp and before the deadline, a part of the whole.
    for arm in (direct, gateway):
        assert 0 < arm["steady"]["rounds"] < arm["rounds_ok"], arm["steady"]
        assert arm["steady"]["ttft_p50_ms"] <= arm["steady"]["ttft_p99_ms"]
    assert report["steady_ttft_p99_ratio"] == gateway["steady"]["ttft_p99_ms"] / direct["steady"]["ttft_p99_ms"]


def test_a_short_chaos_run_survives_one_of_each_fault(tmp_path):
    out = tmp_path / "chaos.json"
    code = run_chaos_bench(Console(file=(tmp_path / "console.txt").open("w")), agents=6, minutes=1.2,
                           interval_s=8.0, down_s=2.0, speed=4.0, rounds=3, out=out)  # fmt: skip
    report = json.loads(out.read_text())
    assert {part for _, part in report["faults"]} == set(FAULTS)
    assert report["rounds_ok"] > 20
    assert report["failed"] == {} and report["text_mismatches"] == 0, report
    # A retry of a request that a killed replica had already recorded runs twice (no idempotency key).
    assert report["lost_rounds"] == 0 and report["duplicated_rounds"] <= report["retried"]
    assert report["sessions_verified"] > 0
    assert code == 0
