"""`ampd bench overhead`: peer configuration, the overhead maths, and a real run of the
direct and ampd arms (the peers install from PyPI, which the suite does not do)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ampd.local_redis import free_port
from ampd.processes import Child, wait_healthy
from bench.overhead import ArmLevel, litellm_config, markdown, overheads, peer_argv
from bench.relay import relay_argv


@pytest.mark.unit
def test_litellm_proxies_the_model_to_the_worker_with_its_extras_off():
    config = json.loads(litellm_config("tiny", "http://127.0.0.1:9000"))
    (entry,) = config["model_list"]
    assert entry["model_name"] == "tiny"
    assert entry["litellm_params"]["model"] == "hosted_vllm/tiny"
    assert entry["litellm_params"]["api_base"] == "http://127.0.0.1:9000/v1"
    assert config["litellm_settings"]["telemetry"] is False and config["general_settings"]["disable_spend_logs"]


def test_peers_start_on_their_port_in_front_of_the_worker():
    venv, config = Path("/v"), Path("/c.json")
    litellm = peer_argv("litellm", venv, 9100, "http://w:1", config)
    assert litellm[0] == "/v/bin/litellm" and litellm[litellm.index("--port") + 1] == "9100"
    assert litellm[litellm.index("--config") + 1] == "/c.json"
    router = peer_argv("vllm-router", venv, 9200, "http://w:1", config)
    assert router[0] == "/v/bin/vllm-router" and router[router.index("--worker-urls") + 1] == "http://w:1"
    assert router[router.index("--port") + 1] == "9200"
    with pytest.raises(ValueError, match="unknown peer"):
        peer_argv("nginx", venv, 1, "http://w:1", config)


def _level(arm: str, streams: int, p50: float, p99: float, rate: float) -> ArmLevel:
    return ArmLevel(arm, streams, 10, p50, p99, p50 + 100, rate, 33.0)


@pytest.mark.unit
def test_overhead_is_measured_against_direct_and_compared_with_ampd():
    levels = [
        _level("direct", 64, 10.0, 20.0, 100.0),
        _level("ampd", 64, 14.0, 30.0, 90.0),  # +4 / +10
        _level("litellm", 64, 22.0, 60.0, 45.0),  # +12 / +40
        _level("direct", 1, 10.0, 10.0, 10.0),
        _level("ampd", 1, 9.0, 10.0, 10.0),  # adds nothing: no ratio
        _level("vllm-router", 1, 11.0, 12.0, 10.0),
    ]
    rows = {(r.arm, r.streams): r for r in overheads(levels)}
    assert set(rows) == {("ampd", 64), ("litellm", 64), ("ampd", 1), ("vllm-router", 1)}
    lite = rows[("litellm", 64)]
    assert (lite.added_p50_ms, lite.added_p99_ms) == (12.0, 40.0)
    assert lite.added_p50_vs_ampd == pytest.approx(3.0) and lite.added_p99_vs_ampd == pytest.approx(4.0)
    assert lite.rate_vs_ampd == pytest.approx(0.5)
    router = rows[("vllm-router", 1)]
    assert router.added_p50_vs_ampd is None and router.added_p99_vs_ampd is None and router.rate_vs_ampd == 1.0
    table = markdown(levels, list(rows.values()), {"vllm-router": "pip install failed: no wheel"})
    assert "| 64 | litellm | 22.0 / 60.0 ms | +12.0 / +40.0 ms | 45 | - | 3.00x, 4.00x, 0.50x |" in table
    assert "vllm-router could not be run: pip install failed: no wheel" in table


def test_the_direct_and_ampd_arms_run_for_real(tmp_path):
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379/13"}
    command = [sys.executable, "-m", "ampd.cli", "bench", "overhead", "--arms", "direct,ampd,ampd-x2,relay",
               "--levels", "1,3", "--requests", "2", "--output-tokens", "8", "--tool-rounds", "2",
               "--out", str(tmp_path / "o.json")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["tool_rounds"] == 2  # every request carried an agent's two tool calls and results
    assert [(x["arm"], x["streams"], x["requests"]) for x in data["levels"]] == [
        ("direct", 1, 2), ("ampd", 1, 2), ("ampd-x2", 1, 2), ("relay", 1, 2),
        ("direct", 3, 6), ("ampd", 3, 6), ("ampd-x2", 3, 6), ("relay", 3, 6),
    ]  # fmt: skip
    # Every token came through the gateway, and the bare relay, as it did directly (8 tokens,
    # plus role and usage events).
    events = {x["arm"]: x["events_per_request"] for x in data["levels"] if x["streams"] == 3}
    assert events["ampd"] == events["ampd-x2"] == events["relay"] == events["direct"] >= 8
    # The gateway's CPU per request is read from /proc - for two processes, the parent's and
    # its children's - and the direct arm has no proxy to charge.
    cpu = {x["arm"]: x["cpu_ms_per_request"] for x in data["levels"] if x["streams"] == 3}
    assert cpu["direct"] is None and 0 < cpu["ampd"] < 1000 and 0 < cpu["ampd-x2"] < 1000 and 0 < cpu["relay"] < 1000
    for row in data["overheads"]:
        assert row["arm"] in ("ampd", "ampd-x2", "relay") and math.isfinite(row["added_p50_ms"])
        assert row["request_rate"] > 0
    assert data["failures"] == {} and "| 3 | ampd |" in (tmp_path / "o.md").read_text()
    wrong = subprocess.run([*command[:5], "--arms", "direct,nginx"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "unknown arms" in wrong.stdout


def test_the_statistics_bench_runs_on_a_redis_of_its_own(tmp_path):
    """`ampd bench signals`: Redis's time per round on the windowed statistics, read off a
    private server's INFO commandstats, one mean read per pool member plus the decode's."""
    command = [sys.executable, "-m", "ampd.cli", "bench", "signals", "--levels", "2,16", "--rounds", "300",
               "--out", str(tmp_path / "s.json")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    levels = json.loads((tmp_path / "s.json").read_text())["levels"]
    assert [(n, x["means"]) for n, x in levels.items()] == [("2", 3), ("16", 17)]
    assert all(x["read_us"] > 0 and x["write_us"] > 0 for x in levels.values())


def test_the_relay_arm_answers_what_it_cannot_relay():
    """The bare relay (bench.relay) serves /health, refuses other paths with a 404, and
    answers a 502 in OpenAI's error shape while its engine cannot be reached."""
    port, dead = free_port(), free_port()
    relay = Child("relay", f"http://127.0.0.1:{port}", subprocess.Popen(relay_argv(port, f"http://127.0.0.1:{dead}")))
    try:
        assert wait_healthy([relay], path="/health") is None
        assert httpx.get(f"{relay.url}/v1/models").status_code == 404
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
        lost = httpx.post(f"{relay.url}/v1/chat/completions", json=body, timeout=30)
        assert lost.status_code == 502 and "unreachable" in lost.json()["error"]["message"]
    finally:
        relay.stop()
