"""The performance model: piecewise fits, profiles, memory model, published checks."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from pydantic import ValidationError

from perfmodel.catalog import GPUS, MODELS
from perfmodel.memory import MemoryPlan, fits, kv_capacity_tokens
from perfmodel.piecewise import Piece, PiecewiseLinear, fit_piecewise
from perfmodel.profile import PROFILES_DIR, Profile, load_profile, shipped_profiles, t_kv
from perfmodel.published import compare_dopd_table_i
from perfmodel.roofline import paper_profiles, roofline_profile

pytestmark = pytest.mark.unit


def test_fit_recovers_a_piecewise_linear_function():
    def truth(x: float) -> float:
        return 0.01 + 0.001 * x if x <= 100 else 0.11 + 0.003 * (x - 100)

    xs = [1, 5, 20, 50, 80, 100, 150, 300, 800, 2000]
    fitted = fit_piecewise(xs, [truth(x) for x in xs], knots=[100], unit="tokens")
    assert fitted.max_rel_error < 1e-9
    assert fitted(60) == pytest.approx(truth(60)) and fitted(1000) == pytest.approx(truth(1000))
    assert len(fitted.pieces) == 2 and fitted.pieces[0].upto == 100


def test_a_run_of_arguments_costs_what_each_call_does_bit_for_bit():
    """``along`` (the fused decode steps' reads) crosses pieces at their ends, integer ends
    and fractional ones, exactly where calling the function argument by argument does."""
    rng = random.Random(4)
    for _ in range(200):
        ends = sorted(rng.sample(range(1, 3000), rng.randint(1, 5)))
        pieces = [Piece(upto=e + rng.choice([0.0, 0.5]), alpha=rng.random(), beta=rng.random() / 1e3) for e in ends]
        f = PiecewiseLinear(unit="tokens", pieces=[*pieces, Piece(upto=None, alpha=rng.random(), beta=rng.random())])
        for _ in range(50):
            start, step, count = rng.randint(1, 3500), rng.randint(1, 300), rng.randint(0, 40)
            assert f.along(start, step, count) == [f(start + i * step) for i in range(count)]
    profile = load_profile("llama-3.1-70b_h20_tp4")
    forward, read = profile.pieces.forward(3), profile.pieces.context_read
    elapsed, ends = 0.0, []
    for i in range(64):
        elapsed += forward + read(5000 + 3 * i)
        ends.append(elapsed)
    assert profile.decode_steps(3, 5000, 64) == ends


def test_parameter_counts_match_the_model_cards():
    counts = {
        name: MODELS[name].params_total / 1e9 for name in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "mixtral-8x7b")
    }
    assert counts == pytest.approx(
        {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "qwen3-32b": 32.76, "mixtral-8x7b": 46.70}, abs=0.01
    )
    assert MODELS["llama-3.1-70b"].kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert MODELS["mixtral-8x7b"].params_active / 1e9 == pytest.approx(12.9, abs=0.05)


def test_memory_model_decides_which_tp_degrees_fit():
    plan = MemoryPlan()
    h20 = GPUS["H20"]
    assert [tp for tp in (1, 2, 4, 8) if fits(MODELS["llama-3.1-70b"], h20, tp, plan)] == [2, 4, 8]
    assert [tp for tp in (1, 2, 4, 8) if fits(MODELS["mixtral-8x7b"], h20, tp, plan)] == [2, 4, 8]
    assert [tp for tp in (1, 2, 4, 8) if fits(MODELS["qwen3-32b"], h20, tp, plan)] == [1, 2, 4, 8]
    # By hand: Llama-70B at TP2 on H20: 0.9 * 96 GiB - 141.1 GB / 2 - 4 GiB, 160 KiB of KV per token per rank.
    free = 0.9 * 96 * 2**30 - 70_553_706_496 - 4 * 2**30
    assert kv_capacity_tokens(MODELS["llama-3.1-70b"], h20, 2, plan) == int(free // (80 * 4 * 128 * 2 * 2))
    # Beyond the KV-head count, heads are replicated: TP8 holds one of Llama's 8 heads per rank, TP16 too.
    assert MODELS["llama-3.1-70b"].kv_heads_per_rank(16) == 1


def test_shipped_profiles_are_the_roofline_as_it_stands():
    """Profiles are generated data: regenerate with `ampd profile ship` when the model changes."""
    expected = {p.name: p for p in paper_profiles()}
    assert sorted(expected) == shipped_profiles()
    for name, profile in expected.items():
        shipped = load_profile(name)
        # Least squares differs in the last bits between BLAS builds: compare the functions, not the floats.
        assert shipped.model_dump(exclude={"pieces"}) == profile.model_dump(exclude={"pieces"}), f"{name} is stale"
        for piece in ("forward", "prefill_attention", "context_read", "kv_transfer"):
            mine, theirs = getattr(shipped.pieces, piece), getattr(profile.pieces, piece)
            assert [q.upto for q in mine.pieces] == [q.upto for q in theirs.pieces], f"{name}.{piece} is stale"
            for x in (1, 7, 100, 3000, 1e5, 1e8, 1e11):
                assert mine(x) == pytest.approx(theirs(x), rel=1e-9), f"{name}.{piece} is stale at {x}"
        assert json.loads((PROFILES_DIR / f"{name}.json").read_text())["model"]["source"]


def test_roofline_reproduces_dopd_table_i():
    rows = compare_dopd_table_i(roofline_profile(MODELS["llama-3.3-70b-fp8"], GPUS["H100"], 1))
    errors = [abs(r.rel_error) for r in rows]
    assert len(rows) == 20
    assert statistics.mean(errors) < 0.10 and max(errors) < 0.25


def test_cost_functions_behave_physically():
    tp2, tp8 = load_profile("llama-3.1-70b_h20_tp2"), load_profile("llama-3.1-70b_h20_tp8")
    # Incremental prefill is cheaper than recomputing the history, dearer than a fresh short prompt.
    assert tp2.t_pre(0, 300) < tp2.t_pre(3000, 300) < tp2.t_pre(0, 3300)
    assert tp8.t_pre(0, 2000) < tp2.t_pre(0, 2000)
    assert tp2.t_dec(1, 1000) < tp2.t_dec(64, 64_000) < 64 * tp2.t_dec(1, 1000)
    # KV moves over min(tp) links; more tokens cost more.
    assert t_kv(1000, tp2, tp8) == t_kv(1000, tp8, tp2) > t_kv(1000, tp8, tp8)
    assert t_kv(2000, tp8, tp8) > t_kv(1000, tp8, tp8) > 0 == t_kv(0, tp8, tp8)


def test_prefill_cost_decomposes_into_its_pieces():
    prof = load_profile("qwen3-32b_h20_tp4")
    h, n = 1200, 300
    pieces = prof.pieces
    assert prof.t_pre(h, n) == pytest.approx(
        pieces.forward(n) + pieces.prefill_attention(n * h + n * (n + 1) / 2) + pieces.context_read(h)
    )


def test_profile_files_are_validated():
    raw = json.loads((PROFILES_DIR / "llama-3.1-8b_h100_tp1.json").read_text())
    raw["model"]["kv_bytes_per_token"] += 1
    with pytest.raises(ValidationError, match="kv_bytes_per_token"):
        Profile.model_validate(raw)
    raw = json.loads((PROFILES_DIR / "llama-3.1-8b_h100_tp1.json").read_text())
    raw["pieces"]["forward"]["pieces"][-1]["upto"] = 5.0
    with pytest.raises(ValidationError):
        Profile.model_validate(raw)
    with pytest.raises(FileNotFoundError, match="shipped profiles"):
        load_profile("no-such-profile")
