"""planner.ilp: the SCIP program for AMPD Eq. (5) against a brute force over every pair.

Real pyscipopt throughout. tau tables are synthetic: decreasing in degree and replicas
(more GPUs per replica, less load per replica), with seeded noise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.ilp import (
    Deployment,
    PoolOption,
    enumerate_deployments,
    objective_key,
    solve,
    solve_with_stats,
)

pytestmark = pytest.mark.unit

DEGREES = (1, 2, 4, 8)


def random_options(rng: np.random.Generator, gpus: int, gpu: str = "H20", quantum: float | None = None):
    """Monotone-ish taus for degrees 1..8 and replicas 1..gpus/n per phase, continuous unless `quantum`."""
    options = []
    for phase in ("prefill", "decode"):
        base, load = rng.uniform(0.2, 1.0), rng.uniform(0.5, 3.0) * gpus / 8
        for n in DEGREES:
            for m in range(1, gpus // n + 1):
                queueing = 1.0 / (1.0 - min(0.95, load / (m * n**0.8)))
                tau = base / n ** rng.uniform(0.5, 0.9) * queueing * rng.uniform(0.9, 1.1)
                if quantum:
                    tau = round(tau / quantum) * quantum
                options.append(PoolOption(phase, gpu, n, m, tau))
    return options


def keys(deployments: list[Deployment]) -> list[tuple[float, float, int]]:
    return [d.key for d in deployments]


@pytest.mark.parametrize("gpus", [8, 16, 32])
@pytest.mark.parametrize("seed", range(4))
def test_top3_matches_brute_force_on_continuous_taus(gpus: int, seed: int) -> None:
    options = random_options(np.random.default_rng(seed), gpus)
    capacity = {"H20": gpus}
    best = solve(options, capacity, top=3)
    brute = enumerate_deployments(options, capacity)
    # Continuous random taus make equal keys (practically) impossible, so pairs must match too.
    assert len({d.key for d in brute[:4]}) == 4
    assert [(d.prefill, d.decode) for d in best] == [(d.prefill, d.decode) for d in brute[:3]]
    assert keys(best) == keys(brute[:3])


@pytest.mark.parametrize("gpus", [8, 16, 32, 64])
@pytest.mark.parametrize("seed", range(3))
def test_topk_keys_match_brute_force_when_taus_tie(gpus: int, seed: int) -> None:
    # Rounded taus tie often, as a simulator's do once a phase has more replicas than it needs;
    # the order of equal-key pairs may differ, the sequence of keys may not.
    options = random_options(np.random.default_rng(100 + seed), gpus, quantum=0.1)
    capacity = {"H20": gpus}
    best = solve(options, capacity, top=6)
    assert keys(best) == keys(enumerate_deployments(options, capacity)[:6])


def test_results_are_distinct_pairs_in_order_and_within_capacity() -> None:
    options = random_options(np.random.default_rng(7), 16)
    results, stats = solve_with_stats(options, {"H20": 16}, top=3)
    assert len(results) == 3
    assert len({(d.prefill, d.decode) for d in results}) == 3
    assert keys(results) == sorted(keys(results))
    assert all(d.gpus_by_type()["H20"] <= 16 for d in results)
    assert stats.statuses == ("optimal",) * 3
    assert stats.variables == len(options) + 1 + 2 * len(DEGREES)  # u per option, Z, x and y per degree


def test_z_is_recomputed_exactly_from_the_chosen_options() -> None:
    options = random_options(np.random.default_rng(3), 8)
    for d in solve(options, {"H20": 8}, top=3):
        assert d.z == max(d.prefill.tau, d.decode.tau)
        assert d.key == objective_key(d.prefill, d.decode)


def test_returns_fewer_when_fewer_pairs_fit() -> None:
    options = [
        PoolOption("prefill", "H20", 4, 1, 0.5),
        PoolOption("prefill", "H20", 8, 1, 0.3),
        PoolOption("decode", "H20", 4, 1, 0.4),
    ]
    # Only (TP4, TP4) fits 8 GPUs; (TP8, TP4) needs 12.
    results = solve(options, {"H20": 8}, top=3)
    assert [(d.prefill.tp, d.decode.tp) for d in results] == [(4, 4)]
    results = solve(options, {"H20": 12}, top=3)
    assert [(d.prefill.tp, d.decode.tp, d.z) for d in results] == [(8, 4, 0.4), (4, 4, 0.5)]


def test_tie_breaks_prefer_the_faster_other_phase_then_fewer_gpus() -> None:
    options = [
        PoolOption("prefill", "H20", 2, 1, 0.8),  # the bottleneck either way
        PoolOption("decode", "H20", 1, 4, 0.6),
        PoolOption("decode", "H20", 2, 2, 0.5),  # same Z, faster decode: first
        PoolOption("decode", "H20", 4, 1, 0.5),  # same Z, same decode tau, same GPUs: tie with TP2
        PoolOption("decode", "H20", 2, 3, 0.5),  # same Z and tau, more GPUs: after those two
        PoolOption("decode", "H20", 1, 1, 0.9),  # a worse Z loses to any tie-break
    ]
    results = solve(options, {"H20": 8}, top=5)
    assert [(d.decode.tp, d.decode.replicas) for d in results][2:] == [(2, 3), (1, 4), (1, 1)]
    assert {(d.decode.tp, d.decode.replicas) for d in results[:2]} == {(2, 2), (4, 1)}


def test_z_dominates_any_tie_break() -> None:
    options = [
        PoolOption("prefill", "H20", 1, 1, 1.0),
        PoolOption("prefill", "H20", 1, 7, 0.999999),  # a hair better Z for 6 more GPUs
        PoolOption("decode", "H20", 1, 1, 0.0),
        PoolOption("decode", "H20", 1, 2, 0.0),
    ]
    best = solve(options, {"H20": 9}, top=1)[0]
    assert best.prefill.replicas == 7


def hetero_options() -> list[PoolOption]:
    """Seed 004's pattern: prefill is fast on the compute-heavy L40, decode on the memory-rich H20."""
    options = []
    speed = {("prefill", "L40"): 1.0, ("prefill", "H20"): 3.0, ("decode", "H20"): 1.0, ("decode", "L40"): 2.5}
    for (phase, gpu), slowdown in speed.items():
        for n in DEGREES:
            for m in range(1, 16 // n + 1):
                queueing = 1.0 / (1.0 - min(0.95, 2.0 / (m * n**0.8)))
                options.append(PoolOption(phase, gpu, n, m, slowdown * 0.3 / n**0.7 * queueing))
    return options


def test_heterogeneous_types_split_the_phases_and_respect_each_capacity() -> None:
    options, capacity = hetero_options(), {"H20": 16, "L40": 8}
    results = solve(options, capacity, top=3)
    best = results[0]
    assert (best.prefill.gpu, best.decode.gpu) == ("L40", "H20")
    for d in results:
        assert all(used <= capacity[gpu] for gpu, used in d.gpus_by_type().items())
    assert keys(results) == keys(enumerate_deployments(options, capacity)[:3])


def test_capacity_is_per_type_not_pooled() -> None:
    options = [
        PoolOption("prefill", "H20", 8, 2, 0.2),  # 16 H20: fits the 24 GPUs in total, not the 16 H20 with decode
        PoolOption("prefill", "L40", 8, 1, 0.6),
        PoolOption("decode", "H20", 8, 1, 0.3),
    ]
    best = solve(options, {"H20": 16, "L40": 8}, top=1)[0]
    assert best.gpus_by_type() == {"L40": 8, "H20": 8}


def test_a_gpu_type_without_capacity_counts_as_zero() -> None:
    options = [
        PoolOption("prefill", "A100", 1, 1, 0.01),  # best by far, but there are no A100s
        PoolOption("prefill", "H20", 1, 1, 0.9),
        PoolOption("decode", "H20", 1, 1, 0.5),
    ]
    results = solve(options, {"H20": 8}, top=3)
    assert [d.prefill.gpu for d in results] == ["H20"]
    assert [d.prefill.gpu for d in enumerate_deployments(options, {"H20": 8})] == ["H20"]


@pytest.mark.parametrize("run", [solve, enumerate_deployments])
def test_a_phase_without_options_is_named(run) -> None:
    with pytest.raises(ValueError, match="no decode option given"):
        run([PoolOption("prefill", "H20", 1, 1, 0.5)], {"H20": 8})


@pytest.mark.parametrize("run", [solve, enumerate_deployments])
def test_a_phase_that_fits_nowhere_is_named_with_the_capacity(run) -> None:
    options = [PoolOption("prefill", "H20", 8, 2, 0.5), PoolOption("decode", "H20", 1, 1, 0.5)]
    with pytest.raises(ValueError, match=r"no prefill option fits within capacity \{'H20': 8\}"):
        run(options, {"H20": 8})
    with pytest.raises(ValueError, match="no decode option fits"):
        run([PoolOption("prefill", "H20", 1, 1, 0.5), PoolOption("decode", "L40", 1, 1, 0.5)], {"H20": 8})


@pytest.mark.parametrize("run", [solve, enumerate_deployments])
def test_phases_that_fit_only_alone_are_reported(run) -> None:
    options = [PoolOption("prefill", "H20", 8, 1, 0.5), PoolOption("decode", "H20", 4, 1, 0.5)]
    with pytest.raises(ValueError, match=r"no prefill option fits together with any decode option.*'H20': 8"):
        run(options, {"H20": 8})


def test_invalid_options_are_refused() -> None:
    with pytest.raises(ValueError, match="tau"):
        PoolOption("prefill", "H20", 1, 1, math.inf)
    with pytest.raises(ValueError, match="tp and replicas"):
        PoolOption("decode", "H20", 0, 1, 0.5)
    with pytest.raises(ValueError, match="phase"):
        PoolOption("mixed", "H20", 1, 1, 0.5)  # type: ignore[arg-type]
    twice = [PoolOption("prefill", "H20", 1, 1, 0.5), PoolOption("prefill", "H20", 1, 1, 0.4)]
    with pytest.raises(ValueError, match="two options"):
        solve([*twice, PoolOption("decode", "H20", 1, 1, 0.5)], {"H20": 8})


def test_an_exhausted_time_limit_returns_what_was_found() -> None:
    options = random_options(np.random.default_rng(5), 8)
    assert solve(options, {"H20": 8}, top=3, time_limit_s=0.0) == []
    with pytest.raises(ValueError, match="top"):
        solve(options, {"H20": 8}, top=0)
