"""Placement rules (rounds.placement), the round core placing with them, agent-population
traces (planner.trace.with_agents) and the simulator's shared prefix blocks."""

from __future__ import annotations

import pytest

from perfmodel.profile import load_profile
from perfmodel.slo import derived_slo
from planner.simulator import Pool, SimConfig, Simulation
from planner.simulator.state import SimSession, shared_prefix
from planner.trace import WORKLOADS, Agents, TraceSession, generate, with_agents
from rounds.binding import DecodeCandidate
from rounds.core import Candidate, Prompt, RoundCore, SessionState, Signals
from rounds.placement import (
    SGLANG_BALANCE_ABS,
    SGLANG_CACHE_THRESHOLD,
    EngineLoad,
    PlacementContext,
    ampd,
    dynamo_kv,
    llmd_prefix,
    memory,
    place,
    sglang_cache,
)
from rounds.policies import POLICIES

pytestmark = pytest.mark.unit

BLOCK = 16


def ctx(
    *engines: EngineLoad, prompt: int = 1600, pool: str = "decode", disaggregated: bool = False
) -> PlacementContext:
    return PlacementContext(pool, prompt, BLOCK, engines, disaggregated)  # type: ignore[arg-type]


def test_memory_takes_the_least_used_kv() -> None:
    assert memory(ctx(EngineLoad("a", kv_usage=0.5), EngineLoad("b", kv_usage=0.2, cached_tokens=0))) == "b"
    assert memory(ctx(EngineLoad("b", kv_usage=0.2), EngineLoad("a", kv_usage=0.2))) == "a"  # ties by id


def test_ampd_weighs_eq1_against_kv_use_among_engines_with_room() -> None:
    capacity = {"kv_capacity_tokens": 100_000}
    cached = EngineLoad("a", cached_tokens=1520, kv_usage=0.15, estimate_s=0.2, **capacity)
    empty = EngineLoad("b", kv_usage=0.1, estimate_s=1.5, **capacity)
    assert ampd(ctx(cached, empty)) == "a"  # 0.13 + 0.5 x 0.15 against 1.0 + 0.5 x 0.1
    # Eq. 1 alone would take the cached engine; its KV use outweighs a small saving.
    close = EngineLoad("b", kv_usage=0.1, estimate_s=0.3, **capacity)
    busy = EngineLoad("a", cached_tokens=1520, kv_usage=0.8, estimate_s=0.2, **capacity)
    assert ampd(ctx(busy, close)) == "b"  # 0.67 + 0.4 against 1.0 + 0.05
    # An engine the prompt's uncached tokens do not fit in is passed over, whatever it caches.
    full = EngineLoad("a", cached_tokens=0, kv_usage=0.99, estimate_s=0.1, **capacity)
    assert ampd(ctx(full, empty)) == "b"
    assert ampd(ctx(full)) == "a"  # ... unless no engine has room


def test_dynamo_weighs_new_prefill_blocks_against_active_blocks() -> None:
    # a: 1600 new tokens (100 blocks) + 0 active = 100 + 100; b: 0 new + 150 active blocks + 0 = 150
    a = EngineLoad("a", kv_capacity_tokens=160_000)
    b = EngineLoad("b", cached_tokens=1600, kv_usage=150 * BLOCK / 160_000, kv_capacity_tokens=160_000)
    assert dynamo_kv(ctx(a, b)) == "b"
    busy = EngineLoad("b", cached_tokens=1600, kv_usage=250 * BLOCK / 160_000, kv_capacity_tokens=160_000)
    assert dynamo_kv(ctx(a, busy)) == "a"


def test_llmd_weighs_prefix_queue_and_kv() -> None:
    hit = EngineLoad("a", cached_tokens=800, waiting=3, kv_usage=0.5)
    idle = EngineLoad("b", waiting=0, kv_usage=0.1)
    # a: 3 * 1 + 2 * 0 + 2 * 0.5 = 4; b: 0 + 2 * 1 + 2 * 0.9 = 3.8
    assert llmd_prefix(ctx(hit, idle)) == "a"
    assert llmd_prefix(ctx(EngineLoad("a", cached_tokens=800, waiting=3, kv_usage=0.7), idle)) == "b"


def test_sglang_follows_a_match_above_its_threshold_else_the_least_loaded() -> None:
    long_match = EngineLoad("a", cached_tokens=1200, running=5)
    idle = EngineLoad("b", running=1)
    assert sglang_cache(ctx(long_match, idle, pool="prefill")) == "a"
    short_match = EngineLoad("a", cached_tokens=int(SGLANG_CACHE_THRESHOLD * 1600) - 16, running=5)
    assert sglang_cache(ctx(short_match, idle, pool="prefill")) == "b"
    swamped = EngineLoad("a", cached_tokens=1200, running=SGLANG_BALANCE_ABS + 2)
    assert sglang_cache(ctx(swamped, idle, pool="prefill")) == "b"
    # Under prefill/decode disaggregation it binds decodes by load alone; where the engine
    # that decodes a session also prefills it, by its cache as for a prefill.
    assert sglang_cache(ctx(long_match, idle, pool="decode", disaggregated=True)) == "b"
    assert sglang_cache(ctx(long_match, idle, pool="decode")) == "a"


def test_place_refuses_no_engines() -> None:
    with pytest.raises(ValueError):
        place("ampd", ctx())


def test_the_core_binds_a_new_session_where_its_prefix_is_cached() -> None:
    profile = load_profile("llama-3.1-70b_h20_tp4")
    decoders = [DecodeCandidate("d0", 0.10, profile.kv_capacity_tokens),
                DecodeCandidate("d1", 0.12, profile.kv_capacity_tokens)]  # fmt: skip
    workers = {d.worker_id: Candidate(d.worker_id, profile) for d in decoders}
    signals = Signals({}, {}, cached_tokens={"d1": 9600})
    prompt = Prompt(10_000, workers, signals)
    assert RoundCore(POLICIES["ampd"]).bind(None, decoders, prompt=prompt).state == SessionState("d0")
    bound = RoundCore(POLICIES["ampd"], placement="ampd").bind(None, decoders, prompt=prompt)
    assert bound.state == SessionState("d1", l_hist=9600) and bound.moved


def test_agent_sessions_share_their_prefix_blocks() -> None:
    plain = generate(WORKLOADS["toolbench"], 40, 1.0, seed=3)
    agents = with_agents(plain, Agents(2, 3), seed=3)
    for before, after in zip(plain, agents, strict=True):
        assert after.rounds[0].input_tokens == before.rounds[0].input_tokens + after.prefix_tokens
        assert after.rounds[1:] == before.rounds[1:] and after.arrival_s == before.arrival_s
        assert 5000 <= after.prefix_tokens <= 25000
    chains: dict[tuple[str, ...], int] = {}
    sims = [SimSession(s, i, shared_prefix(s, chains)) for i, s in enumerate(agents)]
    a, b = next((x, y) for x in sims for y in sims if x is not y and x.trace.prefix == y.trace.prefix)
    other = next(s for s in sims if s.trace.prefix[0] == a.trace.prefix[0] and s.trace.prefix != a.trace.prefix)
    ha, hb, ho = (s.block_hashes(s.trace.rounds[0].input_tokens, BLOCK) for s in (a, b, other))
    shared = a.trace.prefix_tokens // BLOCK
    assert ha[:shared] == hb[:shared] and ha[shared:] != hb[shared:]
    system = a.trace.prefix[0].tokens // BLOCK  # the agent type's system prompt: every tenant's
    assert ha[:system] == ho[:system] and ha[system + 1 : shared] != ho[system + 1 : shared]


def test_a_trace_with_a_prefix_round_trips(tmp_path) -> None:
    from planner.trace import load_trace, write_trace

    trace = with_agents(generate(WORKLOADS["toolbench"], 5, 1.0), Agents(2, 2)) + generate(
        WORKLOADS["hotpotqa"], 1, 1.0
    )
    write_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == sorted(trace, key=lambda s: s.arrival_s)
    assert '"prefix"' not in (tmp_path / "t.jsonl").read_text().splitlines()[-1] or trace[-1].prefix
    with pytest.raises(ValueError):
        TraceSession.model_validate(
            {
                "session_id": "x",
                "arrival_s": 0,
                "prefix": [{"key": "k", "tokens": 9}],
                "rounds": [{"input_tokens": 9, "output_tokens": 1}],
            }  # fmt: skip
        )


def test_simulated_placement_by_the_index_computes_fewer_prefill_tokens() -> None:
    profile = load_profile("llama-3.1-70b_h20_tp4")
    trace = with_agents(generate(WORKLOADS["toolbench"], 60, 0.3, seed=2), Agents(2, 1), seed=2)
    computed = {}
    for placement in ("memory", "ampd"):
        config = SimConfig(Pool(profile, 2), Pool(profile, 2), derived_slo(profile), placement=placement)
        sim = Simulation(config, trace)
        sim.run()
        computed[placement] = sum(w.prefill_tokens for w in sim.workers.values())
        assert len(sim.records) == sum(len(s.rounds) for s in trace)
    assert computed["ampd"] < computed["memory"]
