"""Piecewise alpha-beta functions: the building block of the performance model.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 3) models every cost as a
piecewise alpha-beta function: on each interval of its argument x the time is
``alpha + beta * x`` (Hockney's latency/bandwidth model). The profiler fits one from
measurements and the roofline derives one from first principles; both go through
:func:`fit_piecewise` so a profile always has the same shape whatever produced it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from functools import cached_property

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Piece(BaseModel):
    """``alpha + beta * x`` for x up to ``upto`` (the last piece has ``upto=None``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    upto: float | None = Field(description="upper end of this piece's interval; None = unbounded")
    alpha: float = Field(description="seconds at x = 0 (latency term)")
    beta: float = Field(description="seconds per unit of x (inverse bandwidth term)")


class PiecewiseLinear(BaseModel):
    """A continuous piecewise-linear cost function of one non-negative argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit: str = Field(description="what x counts, e.g. 'tokens' or 'bytes'")
    pieces: list[Piece] = Field(min_length=1)
    max_rel_error: float | None = Field(
        default=None, description="largest relative error of the fit over its sample grid"
    )

    @model_validator(mode="after")
    def _ordered(self) -> PiecewiseLinear:
        ends = [p.upto for p in self.pieces]
        if ends[-1] is not None or any(e is None for e in ends[:-1]):
            raise ValueError("only the last piece may be unbounded, and it must be")
        if any(b <= a for a, b in zip(ends[:-2], ends[1:-1], strict=True)):
            raise ValueError("piece ends must increase")
        return self

    @cached_property
    def _table(self) -> tuple[tuple[float, ...], tuple[tuple[float, float], ...]]:
        """Piece ends and (alpha, beta) as plain tuples: the simulator calls this millions of times."""
        ends = tuple(p.upto for p in self.pieces[:-1])
        return ends, tuple((p.alpha, p.beta) for p in self.pieces)

    def __eq__(self, other: object) -> bool:  # the cached table is not part of the value
        if not isinstance(other, PiecewiseLinear):
            return NotImplemented
        return (self.unit, self.pieces, self.max_rel_error) == (other.unit, other.pieces, other.max_rel_error)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking lists inside: not hashable

    def scaled(self, factor: float) -> PiecewiseLinear:
        """Every piece's cost times ``factor`` (its fit's relative error unchanged)."""
        pieces = [p.model_copy(update={"alpha": p.alpha * factor, "beta": p.beta * factor}) for p in self.pieces]
        return self.model_copy(update={"pieces": pieces})

    def __call__(self, x: float) -> float:
        if x <= 0:
            return 0.0
        ends, coefficients = self._table
        alpha, beta = coefficients[bisect_left(ends, x)]
        return alpha + beta * x

    def along(self, start: int, step: int, count: int) -> list[float]:
        """``[f(start), f(start + step), ...]``, ``count`` values (``start``, ``step`` > 0):
        each piece's run of arguments in one comprehension, bit for bit what calling
        ``f`` on each gives (the simulator's fused decode steps read millions of them)."""
        ends, coefficients = self._table
        out: list[float] = []
        x, stop = start, start + step * count
        while x < stop:
            piece = bisect_left(ends, x)
            alpha, beta = coefficients[piece]
            # The arguments up to this piece's end (inclusive: bisect_left puts x == end here).
            last = stop if piece == len(ends) else min(stop, math.floor(ends[piece]) + 1)
            run = range(x, last, step)
            out += [alpha + beta * v for v in run]
            x = run[-1] + step if run else last
        return out


def fit_piecewise(xs: Sequence[float], ys: Sequence[float], knots: Sequence[float], unit: str) -> PiecewiseLinear:
    """Least-squares fit of a continuous piecewise-linear function with fixed knots.

    Uses the hinge basis ``1, x, max(0, x - k)`` so continuity holds by construction;
    the fit minimises *relative* error (each row is weighted by 1/y) because costs
    span several orders of magnitude and small tasks matter as much as large ones.
    """
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    if x.shape != y.shape or x.size < 2:
        raise ValueError("need at least two (x, y) samples of equal length")
    inner = sorted(k for k in set(knots) if x.min() < k < x.max())
    basis = hinge_columns(x, inner, intercept=True)
    weight = 1.0 / np.maximum(np.abs(y), 1e-12)
    coef, *_ = np.linalg.lstsq(basis * weight[:, None], y * weight, rcond=None)
    fitted = hinge_to_piecewise(float(coef[0]), float(coef[1]), inner, coef[2:], unit)
    predicted = np.array([fitted(v) for v in x])
    rel = np.abs(predicted - y) / np.maximum(np.abs(y), 1e-12)
    return fitted.model_copy(update={"max_rel_error": float(rel.max())})


# -- the hinge basis, shared by fit_piecewise and the profiler's joint fit ------------------


def geometric_knots(xs: Sequence[float], ratio: float) -> list[float]:
    """Knots ``ratio`` apart between the smallest and largest positive x, each snapped to
    the nearest sampled x (in log distance), so every knot sits on data; the end points
    themselves are never knots."""
    values = sorted({float(x) for x in xs if x > 0})
    if len(values) < 3 or ratio <= 1:
        return []
    inner, hi = values[1:-1], values[-1]
    out: set[float] = set()
    k = values[0] * ratio
    while k < hi:
        out.add(min(inner, key=lambda v, k=k: abs(math.log(v / k))))
        k *= ratio
    return sorted(out)


def hinge_columns(x: np.ndarray, knots: Sequence[float], intercept: bool) -> np.ndarray:
    """The basis of :func:`fit_piecewise`: [1,] x, max(0, x - k) per knot."""
    cols = ([np.ones_like(x)] if intercept else []) + [x] + [np.maximum(0.0, x - k) for k in knots]
    return np.column_stack(cols)


def hinge_to_piecewise(
    alpha: float, beta: float, knots: Sequence[float], hinges: Sequence[float], unit: str
) -> PiecewiseLinear:
    """Hinge coefficients as pieces: each knot ends a piece and bends the slope."""
    pieces: list[Piece] = []
    for k, c in zip(knots, hinges, strict=True):
        pieces.append(Piece(upto=float(k), alpha=alpha, beta=beta))
        alpha, beta = alpha - float(c) * k, beta + float(c)
    pieces.append(Piece(upto=None, alpha=alpha, beta=beta))
    return PiecewiseLinear(unit=unit, pieces=pieces)


def slopes_to_piecewise(alpha: float, slopes: Sequence[float], knots: Sequence[float], unit: str) -> PiecewiseLinear:
    """A continuous function from its value at 0 and its slope on each segment between knots."""
    pieces: list[Piece] = []
    for j, slope in enumerate(slopes):
        if j:
            alpha += (float(slopes[j - 1]) - float(slope)) * knots[j - 1]
        upto = float(knots[j]) if j < len(knots) else None
        pieces.append(Piece(upto=upto, alpha=alpha, beta=float(slope)))
    return PiecewiseLinear(unit=unit, pieces=pieces)
