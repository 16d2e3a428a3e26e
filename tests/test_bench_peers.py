"""`ampd bench peers`: the measures, the routers' command lines, the shared-prefix replay, and
a tiny real run of ampd's placements and vllm-router (installed from PyPI) on GPU-free engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_venvs import VENVS, installed
from bench.peers import ArmRun, Counters, PeersSetup, gateway_options, markdown, peer_argv, rows
from bench.replay import LengthDialect, LiveRound, opening
from perfmodel.slo import SLO
from planner.trace import Agents, TraceRound, TraceSession, with_agents


def _round(k: int, ttft_s: float, itl_s: float, p95_s: float) -> LiveRound:
    return LiveRound("s", k, ttft_s, itl_s, p95_s, p95_s, 10, gaps=(itl_s,) * 19 + (p95_s,))


@pytest.mark.unit
def test_rounds_are_judged_in_modelled_time_and_failed_or_lost_rounds_miss():
    slo = SLO(ttft_s=1.0, itl_s=0.1)
    done = [_round(0, 0.1, 0.01, 0.01), _round(1, 0.1, 0.01, 0.03), _round(2, 0.3, 0.01, 0.01)]
    # x5: TTFT 0.5 / 0.5 / 1.5 s; mean gap 0.05 s everywhere; P95 gap 0.05 / 0.15 / 0.05 s
    run = ArmRun("r", done, {"s2": "RuntimeError: 500"}, 6, Counters((100.0, 50.0), (30.0, 0.0), (3.0, 1.0)), 1.0)
    mean, p95 = rows(run, slo, 5.0, ("mean", "p95"))
    assert (mean.itl_rule, p95.itl_rule) == ("mean", "p95")
    assert mean.attainment == pytest.approx(2 / 6) and p95.attainment == pytest.approx(1 / 6)
    assert (mean.failed, mean.lost, mean.rounds) == (1, 2, 6)  # 6 rounds: 3 done, 1 failed, 2 never sent
    assert mean.prefill_tokens == 120  # 150 prompt tokens less 30 from the prefix cache
    assert mean.ttft_p50_ms == pytest.approx(500.0)
    # Round 0 opens its session, rounds 1 and 2 are incremental; the gaps' P95 is over all 60.
    assert mean.initial_ttft_ms == pytest.approx((500.0, 500.0))
    assert mean.incremental_ttft_ms == pytest.approx((1000.0, 1450.0))
    assert mean.gap_p95_ms == pytest.approx(50.0)  # 57 of the 60 gaps are 50 ms
    assert (mean.deployment, mean.engine, mean.simulated_attainment) == ("coloc", "sim", None)
    (pd,) = rows(run, slo, 5.0, ("p95",), "pd", seed=3, simulated={"mean": 0.9, "p95": 0.8})
    assert (pd.deployment, pd.seed, pd.simulated_attainment) == ("pd", 3, 0.8)
    table = markdown([*rows(run, slo, 5.0, ("mean",), simulated={"mean": 0.5})], {"dynamo": "no workers"})
    assert (
        "| r | mean | 33.3% (50.0%) | 500 / 1,400 | 500 / 500 | 1,000 / 1,450 | 50 | 120 | - | 1 / 2 | - / - |" in table
    )
    assert "dynamo could not be run: no workers" in table


@pytest.mark.unit
def test_prefill_tokens_are_what_the_engines_computed_not_what_they_pulled():
    # A P/D round of 100 tokens: the prefill engine computes 100, the decode engine pulls 99
    # and computes 1. Prompt tokens less cache hits would count 200.
    pd = Counters((100.0, 100.0), (0.0, 0.0), (1.0, 1.0), computed_tokens=(100.0, 1.0))
    assert pd.computed == 101
    assert Counters((100.0,), (30.0,), (1.0,)).computed == 70  # engines that keep no count by source


@pytest.mark.unit
def test_step_lateness_reads_as_the_bucket_that_holds_the_quantile():
    before = Counters((0.0,), (0.0,), (0.0,), (0.0,), ((0.001, 5.0), (0.01, 5.0), (float("inf"), 5.0)))
    # over the arm: 90 steps within 1 ms, 8 more within 10 ms, 2 later still
    after = Counters((0.0,), (0.0,), (0.0,), (0.0,), ((0.001, 95.0), (0.01, 103.0), (float("inf"), 105.0)))
    arm = after.minus(before)
    assert (arm.step_lateness_s(0.5), arm.step_lateness_s(0.95), arm.step_lateness_s(0.99)) == (
        0.001,
        0.01,
        float("inf"),
    )
    assert Counters((0.0,), (0.0,), (0.0,)).step_lateness_s(0.5) is None


@pytest.mark.unit
def test_the_routers_start_cache_aware_in_front_of_every_engine():
    workers = ["http://e:1", "http://e:2"]
    vllm = peer_argv("vllm-router", Path("/v"), 9000, workers, 9001)
    assert vllm[0] == "/v/bin/vllm-router" and vllm[vllm.index("--policy") + 1] == "cache_aware"
    assert vllm[vllm.index("--worker-urls") + 1 : vllm.index("--worker-urls") + 3] == workers
    for peer in ("sglang-router", "smg"):
        argv = peer_argv(peer, Path("/v"), 9000, workers, 9001)
        assert argv[:2] == [f"/v/bin/{peer}", "launch"] and argv[argv.index("--policy") + 1] == "cache_aware"
        assert argv[argv.index("--prometheus-port") + 1] == "9001"
    with pytest.raises(ValueError, match="unknown peer"):
        peer_argv("nginx", Path("/v"), 1, workers, 2)


@pytest.mark.unit
def test_vllm_routers_pd_mode_fronts_the_prefill_and_the_decode_engines_with_nixl():
    setup = PeersSetup(engines=3, deployment="pd", prefill_engines=1)
    assert setup.roles() == ["prefill", "decode", "decode"]
    assert PeersSetup(engines=2).roles() == ["both", "both"]
    argv = peer_argv("vllm-router-pd", Path("/v"), 9000, ["http://d:1", "http://d:2"], 9001, ["http://p:1"])
    assert argv[0] == "/v/bin/vllm-router" and "--vllm-pd-disaggregation" in argv
    assert argv[argv.index("--prefill") + 1] == "http://p:1" and argv[argv.index("--kv-connector") + 1] == "nixl"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"] == ["http://d:1", "http://d:2"]
    assert "--policy" not in argv  # its default policy
    with pytest.raises(ValueError, match="prefill engines"):
        peer_argv("vllm-router-pd", Path("/v"), 9000, ["http://d:1"], 9001)
    assert gateway_options("ampd-pd", setup)[:4] == ["--policy", "ampd", "--placement", "ampd"]
    assert gateway_options("ampd-disagg", setup)[:2] == ["--policy", "disagg"]
    assert gateway_options("ampd-llmd-prefix", PeersSetup())[:4] == ["--policy", "coloc", "--placement", "llmd-prefix"]
    assert gateway_options("vllm-router-pd", setup) is None


@pytest.mark.unit
def test_sessions_of_one_agent_open_with_the_same_prefix_and_the_routers_own_fields_only():
    plain = [TraceSession(session_id=f"s{i}", arrival_s=i, rounds=[TraceRound(input_tokens=40, output_tokens=7)])
             for i in range(6)]  # fmt: skip
    sessions = with_agents(plain, Agents(2, 1, system_tokens=(20, 20), tool_tokens=(30, 30)))
    dialect = LengthDialect("m")
    openings = [opening(dialect, i, s) for i, s in enumerate(sessions)]
    by_agent: dict[str, set[str]] = {}
    for s, messages in zip(sessions, openings, strict=True):
        system, user = messages
        assert system["role"] == "system" and len(system["content"].split()) == 50 == s.prefix_tokens
        assert len(user["content"].split()) == 40  # the session's own tokens
        by_agent.setdefault(s.prefix[0].key, set()).add(system["content"])
    assert all(len(texts) == 1 for texts in by_agent.values())  # one prefix per agent type
    body = dialect.body(openings[0], sessions[0], 0)
    assert body["max_tokens"] == 7 and body["ignore_eos"] and "tools" not in body and "sim_script" not in body


def test_ampds_placements_and_vllm_router_run_live_on_a_trace_where_sharing_matters(tmp_path):
    """Ten sessions of two agent types, arriving one after another, on three engines whose KV holds
    dozens of sessions: placing by the cache computes fewer prompt tokens than placing by free
    KV, which spreads each agent's sessions over the engines, each then computing its prompt
    again. (With a KV that holds few sessions, ``ampd``'s KV bound spreads them too.)
    vllm-router runs only where its venv is installed (`make test` installs it): a test
    installs nothing, so without it ampd's arms run and the router's part is skipped."""
    router = installed("vllm-router")
    arms = "ampd-memory,ampd-ampd" + (",vllm-router" if router else "")
    out = tmp_path / "peers.json"
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379/13"}
    command = [sys.executable, "-m", "ampd.cli", "bench", "peers", "--arms", arms,
               "--sessions", "10", "--rate", "0.05", "--agents", "2", "--tenants", "1", "--speed", "10",
               "--num-blocks", "46875", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    failures = data["failures"]
    ran = {r["router"] for r in data["rows"]}
    assert {"ampd-memory", "ampd-ampd"} <= ran, failures
    rounds = data["trace"]["rounds"]
    for row in data["rows"]:
        assert row["prefill_tokens"] > 0 and row["failed"] == 0 and row["lost"] == 0, row
        assert row["rounds"] == rounds and 0.0 <= row["attainment"] <= 1.0
        assert row["ttft_p50_ms"] is not None and row["ttft_p95_ms"] >= row["ttft_p50_ms"]
    by = {(r["router"], r["itl_rule"]): r for r in data["rows"]}
    assert set(by) >= {(a, rule) for a in ("ampd-memory", "ampd-ampd") for rule in ("mean", "p95")}
    assert by[("ampd-ampd", "mean")]["prefill_tokens"] < by[("ampd-memory", "mean")]["prefill_tokens"]
    assert out.with_suffix(".md").read_text().count("| ampd-") == 4
    if not router:
        pytest.skip(
            f"vllm-router is not installed in {VENVS / 'vllm-router'} (`make test` or "
            "`python -m bench.peer_venvs vllm-router` installs it); ampd's arms ran"
        )
    assert "vllm-router" in ran, failures.get("vllm-router")
    assert {("vllm-router", rule) for rule in ("mean", "p95")} <= set(by)


def test_ampds_pd_policies_and_vllm_routers_pd_mode_run_live_on_the_same_prefill_and_decode_engines(tmp_path):
    """``--deployment pd``: one prefill and two decode GPU-free engines behind ampd's P/D
    policies and vllm-router's vLLM P/D mode, every round handed over with NIXL's transfer
    params. Each arm loses nothing, reports initial and incremental TTFT and its P95 gap,
    and ampd's arms carry the simulator's word beside their own. Every prefill vllm-router
    sends is remote, so the prefill engine computes its prompts, and the decode engines
    only the token each pulled prompt leaves to compute; ampd's adaptive policy keeps some
    incremental prefills on their decode engine instead."""
    router = installed("vllm-router")
    arms = "ampd-pd,ampd-disagg" + (",vllm-router-pd" if router else "")
    out = tmp_path / "pd.json"
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:6379/13"}
    command = [sys.executable, "-m", "ampd.cli", "bench", "peers", "--deployment", "pd", "--arms", arms,
               "--sessions", "6", "--rate", "0.05", "--agents", "2", "--tenants", "1", "--speed", "10",
               "--num-blocks", "46875", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    failures, rounds = data["failures"], data["trace"]["rounds"]
    by = {(r["router"], r["itl_rule"]): r for r in data["rows"]}
    assert set(by) >= {(a, rule) for a in ("ampd-pd", "ampd-disagg") for rule in ("mean", "p95")}, failures
    for row in data["rows"]:
        assert row["deployment"] == "pd" and row["failed"] == 0 and row["lost"] == 0 and row["rounds"] == rounds, row
        assert row["prefill_tokens"] > 0 and row["gap_p95_ms"] is not None
        assert None not in row["initial_ttft_ms"] and None not in row["incremental_ttft_ms"], row
        assert (row["simulated_attainment"] is None) == (row["router"] == "vllm-router-pd")
    assert "1 prefill + 2 decode" in out.with_suffix(".md").read_text()
    if not router:
        pytest.skip(
            f"vllm-router is not installed in {VENVS / 'vllm-router'} (`make test` or "
            "`python -m bench.peer_venvs vllm-router` installs it); ampd's arms ran"
        )
    assert ("vllm-router-pd", "p95") in by, failures.get("vllm-router-pd")
