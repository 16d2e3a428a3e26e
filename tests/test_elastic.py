"""Elastic roles: the role state, the controller's moves on hand-made loads, shaped traces."""

from __future__ import annotations

import numpy as np
import pytest

from perfmodel.profile import load_profile
from perfmodel.slo import SLO
from planner.trace import SHAPES, WORKLOADS, Shape, generate_shaped
from rounds.binding import DecodeCandidate
from rounds.core import RoundCore, SessionState
from rounds.elastic import (
    Demand,
    ElasticConfig,
    ElasticController,
    EngineState,
    RolePlan,
    RoleStep,
    balanced_split,
    forecast,
)
from rounds.policies import POLICIES
from rounds.roles import Assignment, move, settle

pytestmark = pytest.mark.unit

TP4 = load_profile("llama-3.1-70b_h20_tp4")
SLO_ = SLO(ttft_s=2.0, itl_s=0.1)


def engine(worker_id: str, role: str, since: float = 0.0, draining=None, **kw) -> EngineState:
    return EngineState(Assignment(worker_id, role, since, draining), TP4, **kw)  # type: ignore[arg-type]


def test_a_move_drains_the_role_it_leaves_until_its_work_is_done():
    decoding = Assignment("e0", "decode", since=0.0)
    moved = move(decoding, "prefill", now=30.0, busy=True)  # two rounds still decode there
    assert (moved.role, moved.draining, moved.since, moved.pool) == ("prefill", "decode", 30.0, "D->P")
    assert not moved.binds and moved.prefills_remote
    assert settle(moved, busy_with={"decode"}) == moved
    assert settle(moved, busy_with={"prefill"}).pool == "P"  # its decodes finished
    assert move(moved, "decode", 40.0, busy=True).draining is None  # back to its own work: no transition
    assert move(decoding, "prefill", 30.0, busy=False).pool == "P"
    assert Assignment("m", "mixed").colocates and Assignment("m", "mixed").binds


def test_a_session_whose_engine_stopped_decoding_reaches_its_kv_there():
    """Bound elsewhere at its next round; the engine that holds its history is where a remote
    prefill finds it cached (Eq. 2), and the new engine pulls it over NIXL."""
    core = RoundCore(POLICIES["elastic"])
    state = SessionState("e0", l_hist=5000, prefill_worker="e3", prefill_cached=2000, rounds=3)
    decoders = [DecodeCandidate("e1", 0.2, 100_000), DecodeCandidate("e2", 0.1, 100_000)]
    bound = core.bind(state, decoders, holders={"e0", "e1", "e2"})  # e0 lives on, as a prefill engine
    assert bound.moved and bound.state == SessionState("e2", 0, "e0", 5000, 3)
    lost = core.bind(state, decoders, holders={"e1", "e2"})  # e0 is gone: nothing of it is reachable
    assert lost.state == SessionState("e2", 0, "e3", 2000, 3)


def test_decode_in_trouble_takes_a_prefill_engine_draining_decodes_first():
    controller = ElasticController(ElasticConfig(), SLO_)
    engines = [
        engine("d0", "decode", windowed_itl=0.15),  # over the 0.1 s ITL threshold
        engine("p0", "prefill", queue_cost_s=0.1),
        engine("p1", "prefill", draining="decode", queue_cost_s=0.5),
    ]
    (chosen,) = controller.tick(100.0, engines)
    assert (chosen.worker_id, chosen.role, chosen.reason) == ("p1", "decode", "decode-slo")
    assert controller.tick(102.0, engines) == []  # one move per cool-down
    fresh = [engine("d0", "decode", windowed_itl=0.15), engine("p0", "prefill", since=95.0)]
    assert ElasticController(ElasticConfig(), SLO_).tick(100.0, fresh) == []  # p0 has not dwelt long enough


def test_prefill_in_trouble_borrows_an_idle_decode_engine_but_never_the_last():
    """Alg. 1's predicted TTFT: 2 s queued on the only prefill engine is over alpha x 2 s."""
    controller = ElasticController(ElasticConfig(), SLO_)
    engines = [
        engine("p0", "prefill", queue_cost_s=2.0),
        engine("d0", "decode", decoding=3, windowed_itl=0.02, kv_usage=0.2),
        engine("d1", "decode", decoding=1, windowed_itl=0.02, kv_usage=0.2),
    ]
    (chosen,) = controller.tick(100.0, engines)
    assert (chosen.worker_id, chosen.role, chosen.reason) == ("d1", "prefill", "prefill-slo")
    busy = [engines[0], engine("d0", "decode", decoding=3, windowed_itl=0.095, kv_usage=0.2)]
    assert ElasticController(ElasticConfig(), SLO_).tick(100.0, busy) == []  # decode is not idle: decode first
    alone = [engines[0], engines[1]]
    assert ElasticController(ElasticConfig(min_decode=1), SLO_).tick(100.0, alone) == []  # the last decode engine


def test_dopd_alone_moves_on_the_forecast_and_on_queues_not_on_the_slo():
    dopd = ElasticController(ElasticConfig(arrow=False), SLO_)
    engines = [engine(f"d{i}", "decode", windowed_itl=0.02, kv_usage=0.1) for i in range(4)]
    heavy = Demand(rounds_per_s=4.0, prefill_tokens=3000, output_tokens=50, context_tokens=4000)
    for _ in range(3):
        dopd.observe(heavy, engines)
    assert dopd.target_prefill is not None and dopd.target_prefill >= 1
    (chosen,) = dopd.tick(100.0, engines)
    assert (chosen.role, chosen.reason) == ("prefill", "forecast")
    slow = [engine("d0", "decode", windowed_itl=0.5), engine("p0", "prefill")]
    assert ElasticController(ElasticConfig(arrow=False, dopd=False), SLO_).tick(100.0, slow) == []


def test_the_split_follows_dopds_ratio():
    """n_p / n_d = cc_d t_p / (t_d OSL): long prefills and short outputs want more prefill engines."""
    prefill_heavy = Demand(rounds_per_s=2.0, prefill_tokens=6000, output_tokens=30, context_tokens=8000)
    decode_heavy = Demand(rounds_per_s=2.0, prefill_tokens=300, output_tokens=800, context_tokens=8000)
    heavy, light = (balanced_split(d, TP4, TP4, 8, SLO_, min_decode=1) for d in (prefill_heavy, decode_heavy))
    assert heavy > light and light >= 0 and heavy <= 7


def test_the_forecast_follows_a_ramp():
    assert forecast([1.0, 2.0]) == 2.0  # too short to fit: the last value
    ramp = [float(i) for i in range(1, 21)]
    assert forecast(ramp) == pytest.approx(21.0, abs=1.0)


@pytest.mark.parametrize("kind", SHAPES)
def test_shaped_traces_follow_their_rate(kind):
    shape = Shape(kind, 1000.0, 0.5, 3.0)
    trace = generate_shaped(WORKLOADS["toolbench"], shape, seed=2, to_workload=WORKLOADS["gaia"])
    arrivals = np.array([s.arrival_s for s in trace])
    per_fifth = [int(((arrivals >= i * 200) & (arrivals < (i + 1) * 200)).sum()) for i in range(5)]
    expected = [200 * np.mean([shape.rate(t) for t in np.linspace(i * 200, (i + 1) * 200, 50)]) for i in range(5)]
    for seen, mean in zip(per_fifth, expected, strict=True):
        assert abs(seen - mean) < 4 * mean**0.5  # a Poisson count within four deviations
    gaia = [s.arrival_s for s in trace if s.session_id.startswith("gaia")]
    if kind == "mix":  # the sessions shift from one workload to the other
        assert np.mean(gaia) > np.mean(arrivals) and len(gaia) > len(trace) / 4
    else:
        assert not gaia
    with pytest.raises(ValueError):
        Shape(kind, 100.0, 2.0, 1.0)


PLAN = RolePlan(
    (
        RoleStep(1.0, {0: 0.99, 1: 0.97, 3: 0.99}),
        RoleStep(2.0, {0: 0.80, 1: 0.60, 3: 0.98}),
        RoleStep(3.0, {0: 0.40, 1: 0.10, 3: 0.05}),
    )
)


def test_a_role_plan_interpolates_between_loads_and_moves_only_for_a_gain_per_engine():
    assert PLAN.attainment(0.5) == PLAN.steps[0].attainment  # below the lightest load: its splits
    assert PLAN.attainment(1.5) == pytest.approx({0: 0.895, 1: 0.785, 3: 0.985})
    assert PLAN.target(1.5) == 3  # nothing to keep: the best outright
    assert PLAN.target(1.5, current=0) == 0  # +9 points is not +5 per engine for three engines
    assert PLAN.target(2.0, current=0) == 3  # +18 points for three engines is
    assert PLAN.target(2.9, current=3) == 0 and PLAN.target(2.9, current=2) == 0  # unplanned split: the best
    with pytest.raises(ValueError, match="rising load"):
        RolePlan((PLAN.steps[1], PLAN.steps[0]))
    with pytest.raises(ValueError):
        RolePlan(())


def test_with_a_plan_the_forecast_moves_the_pool_and_the_slo_triggers_stand_down():
    """Arrow's triggers assume engines that do one phase; under AMPD's routing the plan's
    splits have priced them in. Only a full KV cache still moves an engine at once."""
    planned = ElasticController(ElasticConfig(), SLO_, plan=PLAN)
    late = [engine(f"d{i}", "decode", windowed_itl=0.02, kv_usage=0.2, queue_cost_s=5.0) for i in range(4)]
    assert planned.tick(100.0, late) == []  # prefill is late, but the plan has not asked for a split
    busy = Demand(rounds_per_s=2.0, prefill_tokens=900, output_tokens=60, context_tokens=1500)
    planned.observe(busy, late)
    assert planned.target_prefill == 3
    assert [(m.role, m.reason) for m in planned.tick(100.0, late)] == [("prefill", "forecast")]
    full = [engine("p0", "prefill"), engine("d0", "decode", kv_usage=0.95)]
    assert [(m.role, m.reason) for m in ElasticController(ElasticConfig(), SLO_, plan=PLAN).tick(100.0, full)] == [
        ("decode", "decode-kv")
    ]


def test_the_pool_does_not_move_back_before_the_dwell():
    controller = ElasticController(ElasticConfig(dopd=False), SLO_)
    late = [engine("p0", "prefill", queue_cost_s=3.0), engine("d0", "decode", windowed_itl=0.01),
            engine("d1", "decode", windowed_itl=0.01)]  # fmt: skip
    assert [m.role for m in controller.tick(100.0, late)] == ["prefill"]
    slow = [engine("p0", "prefill"), engine("d1", "prefill"), engine("d0", "decode", windowed_itl=0.2)]
    assert controller.tick(110.0, slow) == []  # decode over its ITL, but the last move went the other way
    assert [m.role for m in controller.tick(121.0, slow)] == ["decode"]
