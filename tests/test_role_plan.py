"""planner.role_plan: the elastic policy's plan, from simulations of a pool's static splits."""

from __future__ import annotations

import numpy as np
import pytest

from perfmodel.slo import SLO
from planner.plan import Judging, ProfileBook
from planner.role_plan import elastic_config, load_levels, pools, split_config, split_ladder
from planner.simulator import simulate
from planner.trace import WORKLOADS, Shape, generate, generate_shaped, respace

pytestmark = pytest.mark.unit

BOOK = ProfileBook("llama-3.1-8b")  # fits TP 1 to 8 on H100
SLO_ = SLO(ttft_s=1.0, itl_s=0.05)
P95 = Judging(BOOK, SLO_, "p95", "elastic")  # the elastic policy, rounds judged by their P95 gap


def run(configs, traces):
    return [simulate(c, t) for c, t in zip(configs, traces, strict=True)]


def test_large_pools_try_a_ladder_of_splits():
    assert split_ladder(1) == [0] and split_ladder(4) == [0, 1, 2, 3]
    assert split_ladder(16) == [0, 1, 2, 3, 4, 8, 12]


def test_load_levels_span_the_trace():
    steady = generate(WORKLOADS["toolbench"], 200, 2.0, seed=1)
    levels = load_levels(steady)
    assert levels == sorted(levels) and 0.8 < levels[0] < 1.2 and 2.7 < levels[-1] < 3.3  # 0.5x to 1.5x its rate
    ramp = generate_shaped(WORKLOADS["toolbench"], Shape("ramp", 1200.0, 0.5, 3.0), seed=1)
    levels = load_levels(ramp)
    assert levels == sorted(levels) and levels[0] < 1.2 and levels[-1] > 2.4  # its minute rates, low to high


def test_each_step_holds_every_split_of_the_pool_as_simulated():
    trace = generate(WORKLOADS["toolbench"], 30, 1.0, seed=3)
    plans = pools(P95, trace, "H100", 4, [0.5, 2.0], run, seed=3)
    assert [(p.tp, p.engines) for p in plans] == [(1, 4), (2, 2), (4, 1)]
    tp1 = plans[0].plan
    rounds = sum(len(s.rounds) for s in trace) / len(trace)
    assert [s.rounds_per_s for s in tp1.steps] == [pytest.approx(0.5 * rounds, abs=1e-3),
                                                   pytest.approx(2.0 * rounds, abs=1e-3)]  # fmt: skip
    assert all(sorted(s.attainment) == [0, 1, 2, 3] for s in tp1.steps)
    again = simulate(split_config(P95, "H100", 1, 4, 2, seed=3), respace(trace, 2.0, 3))
    assert tp1.steps[1].attainment[2] == pytest.approx(again.slo_attainment_rounds, abs=1e-4)
    assert plans[2].plan.steps[0].attainment.keys() == {0}  # one engine: colocated, its only split


def test_the_elastic_pool_starts_at_its_plans_split_and_finishes_every_round():
    shape = Shape("burst", 240.0, 0.5, 3.0)
    trace = generate_shaped(WORKLOADS["toolbench"], shape, seed=4)
    plans = pools(P95, generate_shaped(WORKLOADS["toolbench"], shape, seed=5), "H100", 4, [0.5, 1.5, 3.0], run, seed=5)
    rounds = sum(len(s.rounds) for s in trace) / len(trace)
    for plan in plans:
        config = elastic_config(P95, "H100", plan, shape.low * rounds)
        assert config.initial_prefill == plan.plan.target(shape.low * rounds)
        report = simulate(config, trace)
        assert report.rounds == sum(len(s.rounds) for s in trace)  # no round lost or run twice by a move
        assert report.roles[0].prefill == config.initial_prefill
        assert all(r.prefill + r.decode + r.mixed == plan.engines for r in report.roles)
        assert report.moves == len(report.roles) - 1
        assert np.all(np.diff([r.at for r in report.roles]) >= 0)


def test_only_an_elastic_policy_runs_on_a_role_plan():
    trace = generate(WORKLOADS["toolbench"], 10, 1.0, seed=3)
    (plan, *_) = pools(P95, trace, "H100", 2, [1.0], run, seed=3)
    assert elastic_config(P95, "H100", plan, 1.0).policy == "elastic"
    with pytest.raises(ValueError, match="elastic policy, not 'ampd'"):
        elastic_config(Judging(BOOK, SLO_, "p95"), "H100", plan, 1.0)
