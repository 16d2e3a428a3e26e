"""The roofline's constants fitted jointly to DOPD's Table I and the committed kernel timings
(perfmodel.calibration): the shipped CALIBRATED_EFFICIENCY is what the fit gives, and it
prices what it was fitted to within the issue's 15%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfmodel.calibration import FITTED, Point, calibrate, dopd_points, kernel_points
from perfmodel.roofline import CALIBRATED_EFFICIENCY

pytestmark = pytest.mark.unit
KERNELS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results" / "kernels").glob("*.json"))


def points() -> list[Point]:
    out = dopd_points()
    for path in KERNELS:
        out += kernel_points(json.loads(path.read_text()), path.name)
    return out


def test_the_shipped_calibrated_constants_are_the_fit_of_the_committed_measurements():
    assert len(KERNELS) >= 5
    fitted = calibrate(points()).efficiency
    for name in FITTED:
        assert getattr(fitted, name) == pytest.approx(getattr(CALIBRATED_EFFICIENCY, name), rel=0.01), name


def test_the_calibrated_roofline_prices_what_it_was_fitted_to_within_15_percent():
    fitted = [p for p in points() if p.fitted]
    errors = [abs(p.error(CALIBRATED_EFFICIENCY)) for p in fitted]
    assert sum(errors) / len(errors) < 0.10
    dopd = [abs(p.error(CALIBRATED_EFFICIENCY)) for p in fitted if p.source == "DOPD Table I"]
    assert sum(e <= 0.15 for e in dopd) >= 18 and len(dopd) == 20


def test_the_fit_follows_the_measurements():
    """Engines twice as slow on every DOPD step: the fit moves (no constant is hard-wired)."""
    slower = [Point(p.source, p.what, 2 * p.measured_s if p.source == "DOPD Table I" else p.measured_s, p.price,
                    p.fitted) for p in points()]  # fmt: skip
    moved = calibrate(slower).efficiency
    assert moved.step_overhead_s > CALIBRATED_EFFICIENCY.step_overhead_s or moved.memory < CALIBRATED_EFFICIENCY.memory
