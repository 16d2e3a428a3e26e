"""Fit a measured profile from samples (pure).

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 3) fits
its piecewise alpha-beta cost model to an engine's measured step times. forward,
prefill_attention and context_read are fitted jointly, as one linear least-squares
problem in the hinge basis of :mod:`perfmodel.piecewise` (relative-error weighted);
kv_transfer with :func:`perfmodel.piecewise.fit_piecewise` on bytes per link.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np
from rich.table import Table
from scipy.optimize import nnls

from perfmodel.memory import MemoryPlan
from perfmodel.piecewise import fit_piecewise, geometric_knots, hinge_columns, hinge_to_piecewise, slopes_to_piecewise
from perfmodel.profile import CostPieces, Profile
from perfmodel.roofline import roofline_kv_transfer
from perfmodel.specs import GPUSpec, ModelSpec
from planner.profiler.samples import DecodeSample, Measurements, PrefillSample

# Knot spacing of each piece (ratio between neighbouring knots before snapping to data).
FORWARD_KNOT_RATIO = 2.0  # the memory/compute corner needs resolution
ATTENTION_KNOT_RATIO = 8.0  # FLOP-bound: near-linear in pairs
READ_KNOT_RATIO = 8.0  # bandwidth-bound: near-linear in tokens
TRANSFER_KNOT_RATIO = 16.0  # latency + bandwidth


@dataclass(frozen=True)
class PieceFit:
    """How well the fitted model explains the samples that exercise one piece."""

    piece: str
    unit: str
    samples: int
    knots: tuple[float, ...]
    max_rel_error: float
    mean_rel_error: float
    measured: bool = True


@dataclass(frozen=True)
class FitReport:
    pieces: tuple[PieceFit, ...]
    notes: tuple[str, ...] = field(default=())

    def piece(self, name: str) -> PieceFit:
        for p in self.pieces:
            if p.piece == name:
                return p
        raise KeyError(name)


@dataclass(frozen=True)
class _Rows:
    """The step-time regression's inputs: one row per prefill or decode sample."""

    tokens: np.ndarray
    pairs: np.ndarray
    read: np.ndarray
    seconds: np.ndarray

    @classmethod
    def of(cls, prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]) -> _Rows:
        tokens = [s.l_incr for s in prefill] + [s.batch for s in decode]
        pairs = [s.l_incr * s.l_hist + s.l_incr * (s.l_incr + 1) / 2 for s in prefill] + [0.0] * len(decode)
        read = [s.l_hist for s in prefill] + [s.context for s in decode]
        seconds = [s.seconds for s in prefill] + [s.seconds for s in decode]
        return cls(*(np.asarray(v, dtype=float) for v in (tokens, pairs, read, seconds)))


def _design(rows: _Rows, knots: dict[str, list[float]]) -> np.ndarray:
    return np.hstack(
        [
            hinge_columns(rows.tokens, knots["forward"], intercept=True),
            hinge_columns(rows.pairs, knots["prefill_attention"], intercept=False),
            hinge_columns(rows.read, knots["context_read"], intercept=False),
        ]
    )


def _slopes_to_hinges(knots: dict[str, list[float]]) -> np.ndarray:
    """M with hinge coefficients = M @ (forward's intercept, then every segment's slope).

    A piece's hinge coefficients are its first slope and then each knot's change of
    slope, so with segment slopes s: beta = s_0 and c_j = s_j - s_(j-1).
    """
    sizes = [len(knots["forward"]) + 2, len(knots["prefill_attention"]) + 1, len(knots["context_read"]) + 1]
    out = np.zeros((sum(sizes), sum(sizes)))
    at = 0
    for size in sizes:
        out[at : at + size, at : at + size] = np.eye(size) - np.eye(size, k=-1)
        at += size
    out[1, 0] = 0.0  # forward's intercept stands alone; its slopes start at column 1
    return out


def _solve(design: np.ndarray, y: np.ndarray, transform: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Relative-error least squares (rows weighted by 1/y), columns scaled to unit norm.

    Without ``transform``: the coefficients of ``design``. With ``transform`` M: the
    unknowns z >= 0 of ``design @ M`` (forward's intercept and every segment's slope;
    see :func:`_slopes_to_hinges`): every piece non-decreasing, its constant non-negative.
    Also returns the rank of the scaled problem.
    """
    a = design / np.maximum(np.abs(y), 1e-12)[:, None]
    if transform is not None:
        a = a @ transform
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms
    b = np.ones_like(y)
    if transform is None:
        z, *_ = np.linalg.lstsq(scaled, b, rcond=None)
    else:
        z, _ = nnls(scaled, b)
    return z / norms, int(np.linalg.matrix_rank(scaled))


def _choose_knots(rows: _Rows, ratios: dict[str, float]) -> dict[str, list[float]]:
    """Geometric knots per piece, thinned until the joint problem is well over-determined
    (at most two columns per three samples) and of full rank.

    Each round removes one knot from the piece with the most (forward's count halved:
    its memory/compute corner is the model's main bend; attention and reads are close
    to linear), the one whose removal leaves the smallest gap, so spacing stays even.
    """
    xs = {"forward": rows.tokens, "prefill_attention": rows.pairs, "context_read": rows.read}
    knots = {name: geometric_knots(x, ratios[name]) for name, x in xs.items()}
    limit = max(4, (2 * len(rows.seconds)) // 3)
    while True:
        design = _design(rows, knots)
        if design.shape[1] <= limit and _solve(design, rows.seconds)[1] == design.shape[1]:
            return knots
        if not any(knots.values()):
            return knots
        weight = {"context_read": 1.0, "prefill_attention": 1.0, "forward": 0.5}
        name = max(weight, key=lambda n: len(knots[n]) * weight[n])
        knots[name] = _drop_one(knots[name], xs[name])


def _drop_one(knots: list[float], xs: np.ndarray) -> list[float]:
    """``knots`` less the knot whose neighbours (or the data's ends) are closest, in log."""
    positive = xs[xs > 0]
    ends = [float(positive.min()), *knots, float(positive.max())]
    gaps = [math.log(ends[i + 2] / ends[i]) for i in range(len(knots))]
    drop = gaps.index(min(gaps))
    return knots[:drop] + knots[drop + 1 :]


def _rel(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(p - m) / np.maximum(np.abs(m), 1e-12)


def _stats(rel: np.ndarray) -> tuple[float, float]:
    return (float(rel.max()), float(rel.mean())) if rel.size else (float("nan"), float("nan"))


def fit(
    measurements: Measurements,
    *,
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int,
    kv_capacity_tokens: int,
    name: str,
    ratios: dict[str, float] | None = None,
    monotone: bool = True,
) -> tuple[Profile, FitReport]:
    """Fit a measured profile; pure.

    forward(tokens) + prefill_attention(pairs) + context_read(read) is fitted jointly
    over every prefill and decode sample, each piece in the hinge basis with geometric
    knots on its sampled range (intercept in forward only), minimising relative error.
    With ``monotone`` (the default) the solution is constrained to non-decreasing pieces
    and a non-negative constant (non-negative least squares over segment slopes, the
    same function space): measurement noise and per-request overhead then cannot
    produce costs that fall as work grows. ``ratios`` overrides the knot spacing per
    piece (keys forward, prefill_attention, context_read, kv_transfer).

    The KV transfer is fitted separately on bytes per link (the prefill worker is assumed
    to have the same model and TP degree), as the path it was measured on: kv_transfer_node
    where the two engines share a server (one host), else kv_transfer; the path not measured,
    and both without transfer samples, is the roofline's. The report gives each piece's max
    and mean relative error of the whole prediction on the samples that exercise it.
    """
    if len(measurements.prefill) < 2 or not measurements.decode:
        raise ValueError("need at least two prefill samples and one decode sample")
    ratios = {
        "forward": FORWARD_KNOT_RATIO,
        "prefill_attention": ATTENTION_KNOT_RATIO,
        "context_read": READ_KNOT_RATIO,
        "kv_transfer": TRANSFER_KNOT_RATIO,
    } | (ratios or {})
    rows = _Rows.of(measurements.prefill, measurements.decode)
    knots = _choose_knots(rows, ratios)
    coef, _ = _solve(_design(rows, knots), rows.seconds, _slopes_to_hinges(knots) if monotone else None)
    nf, na = 2 + len(knots["forward"]), 1 + len(knots["prefill_attention"])
    cf, ca, cr = coef[:nf], coef[nf : nf + na], coef[nf + na :]
    if monotone:  # intercept and segment slopes
        forward = slopes_to_piecewise(float(cf[0]), cf[1:], knots["forward"], "tokens")
        attention = slopes_to_piecewise(0.0, ca, knots["prefill_attention"], "query-key pairs")
        read = slopes_to_piecewise(0.0, cr, knots["context_read"], "tokens")
    else:  # hinge coefficients
        forward = hinge_to_piecewise(float(cf[0]), float(cf[1]), knots["forward"], cf[2:], "tokens")
        attention = hinge_to_piecewise(0.0, float(ca[0]), knots["prefill_attention"], ca[1:], "query-key pairs")
        read = hinge_to_piecewise(0.0, float(cr[0]), knots["context_read"], cr[1:], "tokens")

    notes: list[str] = []
    transfer = [s for s in measurements.transfer if s.seconds > 0]
    if len(transfer) < len(measurements.transfer):
        notes.append(f"{len(measurements.transfer) - len(transfer)} transfer samples <= 0 s dropped")
    per_link = [s.tokens * model.kv_bytes_per_token / tp for s in transfer]
    kv_measured = len({s.tokens for s in transfer}) >= 2
    one_server = measurements.prefill_url is not None and _host(measurements.url) == _host(measurements.prefill_url)
    if kv_measured:
        distinct = len(set(per_link))
        kv_knots = geometric_knots(per_link, ratios["kv_transfer"]) if distinct >= 5 else []
        kv = fit_piecewise(per_link, [s.seconds for s in transfer], kv_knots, unit="bytes")
        other = roofline_kv_transfer(gpu, node=not one_server)
        notes.append(f"KV transfer measured {'within one server' if one_server else 'between servers'}; "
                     f"{'between servers' if one_server else 'within one'}: the roofline's")  # fmt: skip
    else:
        kv_knots = []
        kv, other = roofline_kv_transfer(gpu), roofline_kv_transfer(gpu, node=True)
        notes.append("kv_transfer not measured (no prefill worker): the roofline's")
    node_kv, network_kv = (kv, other) if kv_measured and one_server else (other, kv)

    pieces = CostPieces(forward=forward, prefill_attention=attention, context_read=read, kv_transfer=network_kv,
                        kv_transfer_node=node_kv)  # fmt: skip
    draft = Profile(
        name=name,
        method="measured",
        model=model,
        gpu=gpu,
        tp=tp,
        memory=MemoryPlan(),
        kv_capacity_tokens=kv_capacity_tokens,
        pieces=pieces,
    )
    pre_rel = _rel(
        [draft.t_pre(s.l_hist, s.l_incr) for s in measurements.prefill], rows.seconds[: len(measurements.prefill)]
    )
    dec_rel = _rel(
        [draft.t_dec(s.batch, s.context) for s in measurements.decode], [s.seconds for s in measurements.decode]
    )
    kv_rel = _rel([kv(x) for x in per_link], [s.seconds for s in transfer]) if kv_measured else np.array([])

    report = FitReport(
        pieces=(
            PieceFit("forward", "tokens", len(pre_rel), tuple(knots["forward"]), *_stats(pre_rel)),
            PieceFit(
                "prefill_attention",
                "query-key pairs",
                len(pre_rel),
                tuple(knots["prefill_attention"]),
                *_stats(pre_rel),
            ),
            PieceFit("context_read", "tokens", len(dec_rel), tuple(knots["context_read"]), *_stats(dec_rel)),
            PieceFit("kv_transfer", "bytes", len(kv_rel), tuple(kv_knots), *_stats(kv_rel), measured=kv_measured),
        ),
        notes=tuple(notes),
    )
    errors = {p.piece: p.max_rel_error for p in report.pieces}
    measured_kv = kv.model_copy(update={"max_rel_error": errors["kv_transfer"] if kv_measured else None})
    pieces = CostPieces(
        forward=forward.model_copy(update={"max_rel_error": errors["forward"]}),
        prefill_attention=attention.model_copy(update={"max_rel_error": errors["prefill_attention"]}),
        context_read=read.model_copy(update={"max_rel_error": errors["context_read"]}),
        kv_transfer=network_kv if kv_measured and one_server else measured_kv,
        kv_transfer_node=measured_kv if kv_measured and one_server else node_kv,
    )
    profile = draft.model_copy(update={"pieces": pieces, "notes": _notes(measurements, report)})
    return profile, report


def _host(url: str) -> str | None:
    return urlsplit(url).hostname


def _notes(m: Measurements, report: FitReport) -> str:
    where = m.url + (f" (KV from prefill worker {m.prefill_url})" if m.prefill_url else "")
    clock = (
        "client-side (streamed TTFT from sending the request; HTTP and API-server overhead is not subtracted "
        "and so is part of the fitted constants, mostly forward's intercept)"
        if m.clock == "client"
        else "the engine's own TTFT (vllm:time_to_first_token_seconds), without the HTTP part"
    )
    overhead = (
        f" Client minus engine clock: {1e3 * m.api_overhead_seconds:.2f} ms (median, modelled)."
        if m.api_overhead_seconds is not None
        else ""
    )
    text = (
        f"Measured by planner.profiler from {where}, model {m.model_name}, at speed {m.speed:g}, "
        f"{m.measured_at}: {len(m.prefill)} prefill, {len(m.decode)} decode and {len(m.transfer)} transfer "
        f"samples, medians of {m.repeats} runs. Prefill and transfer times are {clock}; decode steps are "
        f"client-side inter-token slopes.{overhead} KV capacity from {m.kv_capacity_source}."
    )
    return " ".join([text, *report.notes])


def report_table(report: FitReport) -> Table:
    """The fit's errors per piece, for the terminal."""
    table = Table("piece", "unit", "samples", "knots", "max rel. error", "mean rel. error", title="profile fit")
    for p in report.pieces:
        samples = str(p.samples) if p.measured else "roofline"
        knots = ", ".join(f"{k:.3g}" for k in p.knots) or "-"
        table.add_row(p.piece, p.unit, samples, knots, _percent(p.max_rel_error), _percent(p.mean_rel_error))
    return table


def _percent(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"
