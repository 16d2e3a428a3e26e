"""The online correction of a profile's step times (perfmodel.step_correction): it learns what
the engine's steps take against the profile, per shape, robustly, within bounds - and the
step sizer then fills its target in the engine's seconds."""

from __future__ import annotations

import random

import pytest

from perfmodel.profile import load_profile
from perfmodel.step_correction import DECODE, MAX_FACTOR, MIN_PREDICTED_S, PREFILL, StepCorrection, shape_of
from rounds.engine.step_budget import step_token_budget
from surface.registry import WorkerInfo

pytestmark = pytest.mark.unit


def test_a_profile_twice_too_dear_is_halved_from_the_steps_and_each_shape_apart():
    correction, rng = StepCorrection(quantile=0.5), random.Random(0)
    for _ in range(100):
        predicted = rng.uniform(0.01, 0.2)
        correction.observe(shape_of(64, 100), predicted, 0.5 * predicted * rng.uniform(0.9, 1.1))
        correction.observe(shape_of(64, 3000), predicted, 0.8 * predicted * rng.uniform(0.9, 1.1))
        correction.observe(DECODE, predicted, 1.5 * predicted * rng.uniform(0.9, 1.1))
    assert correction.factor(shape_of(64, 100)) == pytest.approx(0.5, rel=0.05)
    assert correction.factor(shape_of(64, 3000)) == pytest.approx(0.8, rel=0.05)
    assert correction.factor(DECODE) == pytest.approx(1.5, rel=0.05)
    # A prefill at a history not seen yet is priced as all prefill steps were.
    assert 0.5 < correction.factor(shape_of(64, 1000)) == correction.factor(PREFILL) < 0.8
    assert correction.seen == {"prefill@0": 100, "prefill@2048": 100, PREFILL: 200, DECODE: 100}


def test_prefill_steps_are_told_apart_by_the_octave_of_their_history():
    assert shape_of(0, 5000) == DECODE
    shapes = [shape_of(16, h) for h in (0, 511, 512, 1023, 1024, 4095, 4096)]
    assert shapes == ["prefill@0", "prefill@0", "prefill@512", "prefill@512", "prefill@1024", "prefill@2048",
                      "prefill@4096"]  # fmt: skip


def test_nine_in_ten_steps_fit_the_price_by_default():
    correction = StepCorrection()
    for k in range(60):  # ratios 1.00, 1.01, ... 1.59, in a shuffled order
        correction.observe(DECODE, 0.1, 0.1 * (1 + (k * 37 % 60) / 100))
    assert correction.factor(DECODE) == pytest.approx(1.531, abs=0.002)  # the ninth decile


def test_it_waits_for_enough_steps_and_shrugs_off_outliers():
    correction = StepCorrection(window=16, min_steps=8, quantile=0.5)
    for _ in range(7):
        correction.observe(DECODE, 0.1, 0.2)
    assert correction.factor(DECODE) == 1.0  # seven steps are not yet a finding
    correction.observe(DECODE, 0.1, 0.2)
    assert correction.factor(DECODE) == pytest.approx(2.0)
    for _ in range(7):  # a stall of a second now and then: the median does not follow it
        correction.observe(DECODE, 0.1, 0.2)
        correction.observe(DECODE, 0.1, 1.0)
    assert correction.factor(DECODE) == pytest.approx(2.0)


def test_it_follows_a_drift_within_its_window():
    correction = StepCorrection(window=32, min_steps=8, quantile=0.5)
    for _ in range(50):
        correction.observe(DECODE, 0.02, 0.02)
    assert correction.factor(DECODE) == pytest.approx(1.0)
    for _ in range(17):  # the engine got 3x slower: half the window and one step later it says so
        correction.observe(DECODE, 0.02, 0.06)
    assert correction.factor(DECODE) == pytest.approx(3.0)


def test_it_is_bounded_and_ignores_what_it_cannot_read():
    correction = StepCorrection(min_steps=1)
    correction.observe(DECODE, 0.01, 100.0)
    assert correction.factor(DECODE) == pytest.approx(MAX_FACTOR)
    correction = StepCorrection(min_steps=1)
    correction.observe(DECODE, 0.01, 1e-9)
    assert correction.factor(DECODE) == pytest.approx(1 / MAX_FACTOR)
    correction = StepCorrection(min_steps=1)
    for predicted, measured in ((MIN_PREDICTED_S / 2, 0.01), (0.01, 0.0), (0.01, -1.0), (0.01, float("inf"))):
        correction.observe(DECODE, predicted, measured)
    assert correction.factor(DECODE) == 1.0 and correction.seen == {}
    for bad in ({"window": 4, "min_steps": 5}, {"quantile": 1.0}, {"quantile": 0.0}):
        with pytest.raises(ValueError):
            StepCorrection(**bad)


def test_the_step_sizer_fills_its_target_in_corrected_seconds():
    """A step whose profile price is twice its time: a corrected budget fits twice the
    profile's price into the target, so the step's real time comes back to the target."""
    profile = load_profile("llama-3.1-8b_h100_tp1")
    decoding, target = [2048] * 32, 0.05
    plain = step_token_budget(profile, target, decoding, 0, 8192)
    corrected = step_token_budget(profile, target / 0.5, decoding, 0, 8192)
    assert corrected > plain
    real = 0.5 * profile.step_time([(0, corrected - len(decoding))], decoding)
    assert real <= target and real == pytest.approx(target, rel=0.1)


def test_a_profile_skewed_on_purpose_prices_every_step_times_the_skew_and_moves_kv_as_before():
    profile = load_profile("llama-3.1-8b_h100_tp1")
    skewed = profile.with_step_costs_scaled(0.5)
    for prefills, decodes in (([(0, 512)], []), ([(1024, 64)], [300] * 8), ([], [2048] * 16)):
        assert skewed.step_time(prefills, decodes) == pytest.approx(0.5 * profile.step_time(prefills, decodes))
    assert skewed.pieces.kv_transfer == profile.pieces.kv_transfer


def test_the_registry_carries_an_engines_correction_and_an_older_entry_reads_as_none():
    profile = load_profile("llama-3.1-8b_h100_tp1")
    info = WorkerInfo("w1", "both", "http://127.0.0.1:1", "m", profile, prefill_factor=1.7)
    fields = info.to_redis()
    assert WorkerInfo.from_redis(fields) == info
    del fields["prefill_factor"]  # written by a worker from before the correction
    assert WorkerInfo.from_redis(fields).prefill_factor == 1.0
