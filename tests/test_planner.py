"""Traces, the simulator on the shared cores, and the planner around Eq. 5."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perfmodel.profile import load_profile, t_kv
from perfmodel.slo import SLO, derived_slo
from planner.plan import (
    Judging,
    ProfileBook,
    deployment_file,
    load_deployment,
    parse_gpus,
    parse_pool,
    plan,
    prefill_overwhelmed,
)
from planner.simulator import Pool, SimConfig, Simulation, simulate
from planner.trace import WORKLOADS, TraceRound, TraceSession, generate, load_trace, summarize, write_trace

TP2 = load_profile("llama-3.1-70b_h20_tp2")
TP4 = load_profile("llama-3.1-70b_h20_tp4")
SLO_ = derived_slo(TP2)


# -- traces ---------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_generated_traces_match_table_1(name):
    w = WORKLOADS[name]
    shape = summarize(generate(w, 3000, rate=2.0, seed=7))
    assert shape["mean_rounds"] == pytest.approx(w.mean_rounds, rel=0.04)
    assert shape["mean_prompt_tokens"] == pytest.approx(w.mean_prompt_tokens, rel=0.05)
    assert shape["mean_added_tokens"] == pytest.approx(w.mean_added_tokens, rel=0.04)
    assert shape["mean_output_tokens"] == pytest.approx(w.mean_output_tokens, rel=0.04)
    assert shape["arrival_rate"] == pytest.approx(2.0, rel=0.08)


@pytest.mark.unit
def test_rag_traces_have_exactly_three_rounds_and_agents_spread():
    assert {len(s.rounds) for s in generate(WORKLOADS["hotpotqa"], 200, 1.0)} == {3}
    assert len({len(s.rounds) for s in generate(WORKLOADS["toolbench"], 200, 1.0)}) > 4


@pytest.mark.unit
def test_trace_round_trips_and_bad_lines_are_named(tmp_path: Path):
    trace = generate(WORKLOADS["toolbench"], 20, 1.0, seed=3)
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert load_trace(path) == trace
    lines = path.read_text().splitlines()
    bad = json.loads(lines[4])
    bad["rounds"][-1]["tool_calls"] = 1  # a last round calling tools nobody answers
    path.write_text("\n".join(lines[:4] + [json.dumps(bad)] + lines[5:]) + "\n")
    with pytest.raises(ValueError, match=r"(?s)t\.jsonl:5: .*last round"):
        load_trace(path)
    path.write_text(lines[0] + "\n" + lines[0] + "\n")
    with pytest.raises(ValueError, match="duplicate session id"):
        load_trace(path)


# -- the simulator --------------------------------------------------------------------
def one_round(input_tokens: int, output_tokens: int) -> list[TraceSession]:
    return [TraceSession(session_id="s", arrival_s=0.0,
                         rounds=[TraceRound(input_tokens=input_tokens, output_tokens=output_tokens)])]  # fmt: skip


@pytest.mark.unit
def test_an_unloaded_remote_round_costs_exactly_what_the_profiles_say():
    """vLLM's hand-off: prefill on P, pull to D, recompute the last token on D, then decode."""
    config = SimConfig(decode=Pool(TP4, 1), prefill=Pool(TP2, 1), slo=SLO_, policy="disagg")
    sim = Simulation(config, one_round(1000, 20))
    sim.run()
    (record,) = sim.records
    expected_ttft = TP2.t_pre(0, 1000) + t_kv(1000, TP2, TP4, same_node=True) + TP4.t_pre(999, 1)  # one server
    assert record.route == "remote"
    assert record.prefill_s == pytest.approx(TP2.t_pre(0, 1000))
    assert record.ttft_s == pytest.approx(expected_ttft)
    expected_itl = sum(TP4.t_dec(1, 1000 + k) for k in range(19)) / 19  # context grows one token a step
    assert record.mean_itl_s == pytest.approx(expected_itl)
    for worker in sim.workers.values():  # everything handed back: no blocks in use, no holds
        assert worker.scheduler.kv.num_free_blocks == worker.scheduler.kv.num_blocks
        assert not worker.scheduler.held and not worker.scheduler.requests


@pytest.mark.unit
def test_fused_decode_steps_change_nothing():
    """Many sessions, two decode workers (binding reads KV usage mid-step): identical records."""
    trace = generate(WORKLOADS["toolbench"], 80, 0.8, seed=3)
    records = []
    for steps in (1, 64):
        config = SimConfig(decode=Pool(TP4, 2), prefill=Pool(TP4, 1), slo=SLO_, max_decode_steps=steps)
        sim = Simulation(config, trace)
        sim.run()
        records.append(sorted(sim.records, key=lambda r: (r.session_id, r.round)))
    single, fused = records
    assert len(single) == sum(len(s.rounds) for s in trace)
    for a, b in zip(single, fused, strict=True):
        assert (a.route, a.completion_tokens) == (b.route, b.completion_tokens)
        assert a.ttft_s == pytest.approx(b.ttft_s, abs=1e-9)
        assert (a.mean_itl_s or 0.0) == pytest.approx(b.mean_itl_s or 0.0, abs=1e-9)


@pytest.mark.unit
def test_policies_route_as_they_say_and_every_round_completes():
    trace = generate(WORKLOADS["toolbench"], 60, 0.5, seed=5)
    rounds = sum(len(s.rounds) for s in trace)
    coloc = simulate(SimConfig(decode=Pool(TP4, 2), prefill=None, slo=SLO_, policy="coloc"), trace)
    disagg = simulate(SimConfig(decode=Pool(TP4, 1), prefill=Pool(TP4, 1), slo=SLO_, policy="disagg"), trace)
    ampd = simulate(SimConfig(decode=Pool(TP4, 1), prefill=Pool(TP4, 1), slo=SLO_, policy="ampd"), trace)
    assert coloc.rounds == disagg.rounds == ampd.rounds == rounds
    assert coloc.local_share == 1.0 and disagg.local_share == 0.0
    assert 0.0 <= ampd.local_share_incremental <= 1.0
    assert [w.role for w in coloc.workers] == ["decode", "decode"]
    assert all(0.0 < w.utilisation <= 1.0 for w in disagg.workers)


@pytest.mark.unit
def test_overload_shows_in_the_report():
    config = SimConfig(decode=Pool(TP4, 1), prefill=Pool(TP4, 1), slo=SLO_)
    light = simulate(config, generate(WORKLOADS["toolbench"], 40, 0.1, seed=1))
    heavy = simulate(config, generate(WORKLOADS["toolbench"], 150, 3.0, seed=1))
    assert heavy.ttft.p95_s > 3 * light.ttft.p95_s
    assert heavy.slo_attainment_rounds < light.slo_attainment_rounds


# -- planning -------------------------------------------------------------------------
@pytest.mark.unit
def test_a_prefill_replica_is_not_simulated_only_where_it_would_be_far_past_the_slo():
    """plan.prefill_overwhelmed is a bound, not a guess: where it spares a simulation, the
    simulation finds the replica's tau_pre far above 1; where the replica keeps up, it
    does not spare it."""
    config = SimConfig(decode=Pool(TP4, 4), prefill=Pool(TP2, 1), slo=SLO_, policy="disagg")
    for rate, overwhelmed in ((40.0, True), (0.5, False)):
        share = generate(WORKLOADS["toolbench"], 120, rate, seed=2)
        assert prefill_overwhelmed(TP2, share, SLO_) is overwhelmed
        tau = simulate(config, share).tau_prefill
        assert tau is not None and (tau > 2 if overwhelmed else tau < 1)


@pytest.mark.unit
def test_parsers_refuse_what_they_cannot_read():
    assert parse_gpus("8") == {"H20": 8}
    assert parse_gpus("H20=16,L40=8") == {"H20": 16, "L40": 8}
    assert parse_pool("4x2") == (4, 2)
    for bad in ("H20", "B200=8", "H20=0"):
        with pytest.raises(ValueError):
            parse_gpus(bad)
    for bad in ("4", "4x", "0x1", "ax2"):
        with pytest.raises(ValueError):
            parse_pool(bad)


@pytest.mark.unit
def test_profile_book_knows_which_degrees_fit():
    book = ProfileBook("llama-3.1-70b")
    assert book.feasible("H20") == [2, 4, 8]  # 141 GB of weights do not fit one 96 GB H20
    assert book.feasible("L40") == [4, 8]  # 48 GB L40s: four hold the weights and a full-length KV cache
    assert book.get("L40", 8).gpu.name == "L40"  # derived on demand: not shipped
    with pytest.raises(ValueError, match="does not fit"):
        book.get("H20", 1)


@pytest.mark.unit
def test_a_plan_spread_over_processes_equals_one_made_one_by_one():
    """plan(jobs=2) runs its simulations in two processes, longest first: the same taus,
    the same ranking and the same predicted rounds as one after another."""
    book = ProfileBook("llama-3.1-70b")
    trace = generate(WORKLOADS["toolbench"], 60, 0.6, seed=5)
    one, two = (plan(Judging(book, SLO_), trace, {"H20": 8}, candidates=4, jobs=jobs) for jobs in (1, 2))
    assert [(o.phase, o.tp, o.replicas, o.tau) for o in one.options] == [
        (o.phase, o.tp, o.replicas, o.tau) for o in two.options
    ]
    assert [(r.deployment, r.eq5_rank, r.predicted.round_latencies) for r in one.ranked] == [
        (r.deployment, r.eq5_rank, r.predicted.round_latencies) for r in two.ranked
    ]


def test_plan_picks_within_capacity_and_writes_the_deployment(tmp_path: Path):
    book = ProfileBook("llama-3.1-70b")
    trace = generate(WORKLOADS["toolbench"], 60, 0.4, seed=2)
    judging = Judging(book, SLO_, policy="ampd")
    result = plan(judging, trace, {"H20": 8}, top=3, candidates=4)
    assert 1 <= len(result.ranked) <= 3
    assert len({(r.deployment.prefill, r.deployment.decode) for r in result.ranked}) == len(result.ranked)
    for r in result.ranked:
        assert r.deployment.gpus <= 8 and r.eq5_rank >= 1
    attainments = [r.predicted.slo_attainment_rounds for r in result.ranked]
    assert attainments == sorted(attainments, reverse=True)
    best = deployment_file(judging, result.ranked[0])
    env = best.write(tmp_path / "deployment.json")
    assert load_deployment(tmp_path / "deployment.json") == best
    assert f"PREFILL_TP={best.prefill.tp}\n" in env.read_text()


@pytest.mark.unit
def test_heterogeneous_plan_keeps_each_type_within_its_own_capacity():
    book = ProfileBook("llama-3.1-70b")
    trace = generate(WORKLOADS["toolbench"], 40, 0.3, seed=4)
    result = plan(Judging(book, SLO_), trace, {"H20": 4, "L40": 8}, top=3, candidates=3)
    for r in result.ranked:
        used = r.deployment.gpus_by_type()
        assert used.get("H20", 0) <= 4 and used.get("L40", 0) <= 8
    assert {o.gpu for o in result.options} == {"H20", "L40"}


def test_cli_generates_simulates_and_plans(tmp_path: Path):
    def ampd(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ampd.cli", *args], capture_output=True, text=True, timeout=300)

    trace = tmp_path / "tb.jsonl"
    assert ampd("trace", "generate", "--out", str(trace), "--sessions", "40", "--rate", "0.4").returncode == 0
    done = ampd(
        "simulate", "--trace", str(trace), "--prefill", "4x1", "--decode", "4x1", "--out", str(tmp_path / "r.json")
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rounds"] == sum(len(s.rounds) for s in load_trace(trace))
    bad = ampd("simulate", "--trace", str(trace), "--prefill", "1x1")  # 70B does not fit one H20
    assert bad.returncode == 2 and "does not fit" in bad.stdout
    out = tmp_path / "deploy" / "deployment.json"
    done = ampd("plan", "--trace", str(trace), "--gpus", "8", "--candidates", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert load_deployment(out).prefill.tp in (2, 4)
    assert out.with_suffix(".env").exists()


@pytest.mark.unit
def test_explicit_slo_overrides_the_derived_one():
    trace = one_round(1000, 10)
    tight = simulate(SimConfig(decode=Pool(TP4, 1), prefill=Pool(TP4, 1), slo=SLO(0.01, 0.001)), trace)
    assert tight.slo_attainment_rounds == 0.0 and tight.slo_attainment_sessions == 0.0
