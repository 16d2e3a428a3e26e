"""Measure a running engine and fit a profile from it (``method="measured"``).

AMPD (shared/seeds/003_517589c8db448ff1.txt, section 3) fits its piecewise alpha-beta
cost model to an engine's measured step times. This module does that for any engine
with vLLM's OpenAI HTTP surface (real vLLM or the GPU-free ``ampd worker sim``):

* :func:`measure` (I/O) times the engine over a :class:`Grid`:

  - *prefill*: for each (l_hist, l_incr), a prompt of l_hist fresh random tokens warms
    the prefix cache (``max_tokens=1``), then the streamed time to first token of that
    prompt extended by l_incr new tokens is one step T_pre(l_hist, l_incr). The cache
    hit is checked on ``vllm:prefix_cache_hits``; the sample records what really hit.
  - *decode*: b concurrent streams with c-token prompts (``ignore_eos``); once every
    stream has its first token the batch decodes alone, and each stream's mean
    inter-token gap over the following ``steady_tokens`` tokens is one decode step of
    batch b; the median over streams is the sample, with the batch's mean total context.
  - *KV transfer* (with a prefill worker): vLLM's NixlConnector hand-off as the gateway
    runs it; the decode request's time to first token is T_kv(l) plus the recompute
    of the last prompt token, T_pre(l - 1, 1), which is measured on the decode engine
    separately (l - 1 a multiple of the block size, so the cache hit is exact) and
    subtracted.

  Every time is a median over ``repeats`` fresh samples, multiplied by ``speed`` (a
  GPU-free worker started with ``--speed s`` runs s times faster than the GPU it
  models). Nothing else is subtracted. First tokens are timed by one of two clocks:
  ``clock="client"`` (the default) from sending the request to receiving its token,
  so HTTP, JSON and API-server overhead is inside every prefill and transfer sample
  and ends up in the fitted constants (mostly forward's intercept); ``clock="engine"``
  reads the engine's own TTFT (the growth of ``vllm:time_to_first_token_seconds_sum``
  across the lone request), which leaves the HTTP part out. Both are recorded; the
  median difference is ``Measurements.api_overhead_seconds``. Decode steps are always
  timed at the client: the slope of token arrivals carries no per-request overhead.

* :func:`fit` (pure) turns the samples into a :class:`~perfmodel.profile.Profile`:
  forward, prefill_attention and context_read jointly, as one linear least-squares
  problem in the hinge basis of :mod:`perfmodel.piecewise` (relative-error weighted),
  and kv_transfer with :func:`perfmodel.piecewise.fit_piecewise` on bytes per link.

* :func:`profile_worker` does both and writes the profile file.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from rich.table import Table
from scipy.optimize import nnls

from perfmodel.memory import MemoryPlan
from perfmodel.memory import kv_capacity_tokens as modelled_kv_capacity
from perfmodel.piecewise import Piece, PiecewiseLinear, fit_piecewise
from perfmodel.profile import CostPieces, Profile
from perfmodel.specs import GPUSpec, ModelSpec
from workers import wire

Progress = Callable[[str], None]
Clock = Literal["client", "engine"]  # whose clock times a first token (see _Target.first_token)

# Random prompt tokens come from this id range: ordinary tokens in every catalogued
# vocabulary (>= 32000 entries), never the low special ids.
TOKEN_IDS = (1000, 30000)

# Knot spacing of each piece (ratio between neighbouring knots before snapping to data).
FORWARD_KNOT_RATIO = 2.0  # the memory/compute corner needs resolution
ATTENTION_KNOT_RATIO = 8.0  # FLOP-bound: near-linear in pairs
READ_KNOT_RATIO = 8.0  # bandwidth-bound: near-linear in tokens
TRANSFER_KNOT_RATIO = 16.0  # latency + bandwidth


class ProfilerError(RuntimeError):
    """The engine answered something the profiler cannot use."""


# -- what is measured ------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """Where to sample the engine; points beyond its max_model_len or KV cache are skipped.

    ``prefill_hist`` values and ``transfer_tokens - 1`` should be multiples of the
    engine's KV block size (so prefix-cache hits are exact); ``prefill_incr`` should
    stay within ``max_num_batched_tokens`` (so a prefill is one step).
    """

    prefill_hist: tuple[int, ...] = (0, 512, 2048, 8192)
    prefill_incr: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    decode_batch: tuple[int, ...] = (1, 4, 16, 64)
    decode_context: tuple[int, ...] = (128, 1024, 4096)
    transfer_tokens: tuple[int, ...] = (257, 1025, 4097, 16385)
    repeats: int = 3  # samples per prefill / transfer point (median)
    decode_repeats: int = 1  # batches per decode point (each already a median over its streams)
    steady_tokens: int = 16  # decode steps timed per stream once the whole batch decodes
    min_chunk_tokens: int = 512  # smallest per-step token budget assumed when sizing max_tokens

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.decode_repeats < 1 or self.steady_tokens < 2 or self.min_chunk_tokens < 1:
            raise ValueError("repeats and decode_repeats must be >= 1, steady_tokens >= 2")
        sizes = [*self.prefill_incr, *self.decode_batch, *self.decode_context, *self.transfer_tokens]
        if any(n < 1 for n in sizes) or any(n < 0 for n in self.prefill_hist):
            raise ValueError("grid sizes must be positive (prefill_hist may be 0)")


class PrefillSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    l_hist: int = Field(ge=0, description="tokens the prefix cache supplied")
    l_incr: int = Field(ge=1, description="tokens computed")
    seconds: float = Field(description="modelled seconds: median TTFT (by the measurement's clock) x speed")
    runs: list[float] = Field(default_factory=list, description="every run, modelled seconds")


class DecodeSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch: int = Field(ge=1)
    context: float = Field(ge=0, description="total KV tokens of the batch, mean over the timed steps")
    seconds: float = Field(description="modelled seconds per decode step")
    prompt_tokens: int = Field(ge=1, description="prompt length of each stream")


class TransferSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=1, description="tokens whose KV moved")
    seconds: float = Field(description="modelled T_kv: total - recompute")
    total_seconds: float = Field(description="decode request's TTFT with the hand-off, modelled")
    recompute_seconds: float = Field(description="T_pre(tokens - 1, 1) on the decode engine, modelled")


class Measurements(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    prefill_url: str | None = None
    model_name: str
    max_model_len: int
    speed: float = Field(gt=0)
    clock: Clock = "client"
    kv_capacity_tokens: int | None = None
    kv_capacity_source: str = "unknown"
    block_size: int | None = None
    api_overhead_seconds: float | None = Field(
        default=None,
        description="median client-clock minus engine-clock first-token time (HTTP and API server), modelled",
    )
    repeats: int = 1
    measured_at: str = ""
    prefill: list[PrefillSample] = Field(default_factory=list)
    decode: list[DecodeSample] = Field(default_factory=list)
    transfer: list[TransferSample] = Field(default_factory=list)


# -- fitting (pure) ------------------------------------------------------------------


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
    """The basis of :func:`perfmodel.piecewise.fit_piecewise`: [1,] x, max(0, x - k) per knot."""
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


def slopes_to_piecewise(alpha: float, slopes: Sequence[float], knots: Sequence[float], unit: str) -> PiecewiseLinear:
    """A continuous function from its value at 0 and its slope on each segment between knots."""
    pieces: list[Piece] = []
    for j, slope in enumerate(slopes):
        if j:
            alpha += (float(slopes[j - 1]) - float(slope)) * knots[j - 1]
        upto = float(knots[j]) if j < len(knots) else None
        pieces.append(Piece(upto=upto, alpha=alpha, beta=float(slope)))
    return PiecewiseLinear(unit=unit, pieces=pieces)


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


def roofline_kv_transfer(gpu: GPUSpec) -> PiecewiseLinear:
    """The roofline's T_kv piece (perfmodel.roofline.HOPPER_EFFICIENCY), for profiles
    measured without a prefill worker."""
    from perfmodel.roofline import HOPPER_EFFICIENCY as eff

    beta = 1.0 / (gpu.network_bandwidth * eff.network)
    return PiecewiseLinear(unit="bytes", pieces=[Piece(upto=None, alpha=eff.kv_transfer_latency_s, beta=beta)])


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

    kv_transfer is fitted separately on bytes per link (the prefill worker is assumed
    to have the same model and TP degree). Without transfer samples, kv_transfer is the
    roofline's. The report gives each piece's max and mean relative error of the whole
    prediction on the samples that exercise it.
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
    if kv_measured:
        distinct = len(set(per_link))
        kv_knots = geometric_knots(per_link, ratios["kv_transfer"]) if distinct >= 5 else []
        kv = fit_piecewise(per_link, [s.seconds for s in transfer], kv_knots, unit="bytes")
    else:
        kv_knots = []
        kv = roofline_kv_transfer(gpu)
        notes.append("kv_transfer not measured (no prefill worker): the roofline's")

    pieces = CostPieces(forward=forward, prefill_attention=attention, context_read=read, kv_transfer=kv)
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
    pieces = CostPieces(
        forward=forward.model_copy(update={"max_rel_error": errors["forward"]}),
        prefill_attention=attention.model_copy(update={"max_rel_error": errors["prefill_attention"]}),
        context_read=read.model_copy(update={"max_rel_error": errors["context_read"]}),
        kv_transfer=kv.model_copy(update={"max_rel_error": errors["kv_transfer"] if kv_measured else None}),
    )
    profile = draft.model_copy(update={"pieces": pieces, "notes": _notes(measurements, report)})
    return profile, report


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


# -- measuring (I/O) -----------------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    """One first token, by both clocks (wall seconds)."""

    client_s: float
    engine_s: float | None  # None where the engine exports no TTFT histogram
    prefix_hits: float | None  # prompt tokens the prefix cache supplied, if the engine says
    clock: Clock

    @property
    def seconds(self) -> float:
        if self.clock == "client":
            return self.client_s
        if self.engine_s is None:
            raise ProfilerError("the engine clock needs vllm:time_to_first_token_seconds, which the engine lacks")
        return self.engine_s


def _growth(before: dict[str, float] | None, after: dict[str, float] | None, *names: str) -> float | None:
    """How much the first of ``names`` present in both scrapes grew."""
    if before is None or after is None:
        return None
    for name in names:
        if name in before and name in after:
            return after[name] - before[name]
    return None


@dataclass
class _Target:
    """One engine under measurement."""

    client: httpx.AsyncClient
    url: str
    model: str
    clock: Clock = "client"
    timings: list[Timed] = field(default_factory=list)

    async def metrics(self) -> dict[str, float] | None:
        """Samples of /metrics by name (labels dropped, summed), or None if it has none."""
        try:
            response = await self.client.get(f"{self.url}/metrics", timeout=10)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return wire.metric_totals(response.text)

    def body(self, prompt: list[int], max_tokens: int, **extra: Any) -> bytes:
        payload = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
        return json.dumps(payload, separators=(",", ":")).encode()

    async def complete(self, prompt: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
        response = await self.client.post(
            f"{self.url}/v1/completions", content=self.body(prompt, max_tokens, **extra), headers=_JSON
        )
        if response.status_code != 200:
            raise ProfilerError(f"{self.url}/v1/completions: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    async def first_token(self, prompt: list[int], **extra: Any) -> Timed:
        """Time a streamed one-token completion on an otherwise idle engine.

        The client clock runs from sending the (already encoded) request to receiving
        its token; the engine clock is the engine's own TTFT for it, the growth of
        ``vllm:time_to_first_token_seconds_sum`` across the request.
        """
        before = await self.metrics()
        client_s = await self._stream_one_token(prompt, **extra)
        after = await self.metrics()
        count = _growth(before, after, f"{wire.TTFT}_count")
        for _ in range(40):  # vLLM records a step's stats a moment after streaming its outputs
            if count is None or count >= 1:
                break
            await asyncio.sleep(0.025)
            after = await self.metrics()
            count = _growth(before, after, f"{wire.TTFT}_count")
        hits = _growth(before, after, f"{wire.PREFIX_CACHE_HITS}_total", wire.PREFIX_CACHE_HITS)
        engine_s = _growth(before, after, f"{wire.TTFT}_sum") if count == 1 else None
        if self.clock == "engine" and count not in (None, 1):
            raise ProfilerError(f"{self.url}: {count} first tokens during one request; is something else using it?")
        timed = Timed(client_s, engine_s, hits, self.clock)
        self.timings.append(timed)
        return timed

    async def _stream_one_token(self, prompt: list[int], **extra: Any) -> float:
        content = self.body(prompt, 1, stream=True, **extra)
        first: float | None = None
        start = time.perf_counter()
        async with self.client.stream("POST", f"{self.url}/v1/completions", content=content, headers=_JSON) as r:
            if r.status_code != 200:
                raise ProfilerError(f"{self.url}/v1/completions: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ProfilerError(f"{self.url} failed mid-stream: {chunk['error']}")
                if first is None and chunk.get("choices"):
                    first = time.perf_counter()
        if first is None:
            raise ProfilerError(f"{self.url}: the stream ended without a token")
        return first - start

    async def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until no request runs or waits (aborted streams take a moment to go)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            metrics = await self.metrics()
            if metrics is None:
                await asyncio.sleep(0.5)
                return
            busy = metrics.get(wire.RUNNING, 0) + metrics.get(wire.WAITING, 0)
            if busy == 0:
                return
            await asyncio.sleep(0.05)
        raise ProfilerError(f"{self.url} did not go idle within {timeout_s:.0f} s")


_JSON = {"Content-Type": "application/json"}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


async def _models(client: httpx.AsyncClient, url: str) -> tuple[str, int]:
    response = await client.get(f"{url}/v1/models")
    if response.status_code != 200:
        raise ProfilerError(f"{url}/v1/models: HTTP {response.status_code}")
    entry = response.json()["data"][0]
    return entry["id"], int(entry.get("max_model_len") or 0)


async def _kv_capacity(t: _Target, rng: random.Random, max_model_len: int) -> tuple[int | None, int | None, str]:
    """(KV capacity in tokens, block size, where they came from).

    vLLM exports ``vllm:cache_config_info`` (labels num_gpu_blocks, block_size). Where
    that is missing (the GPU-free engine), a probe holds a known number of tokens and
    reads ``vllm:kv_cache_usage_perc``: capacity = tokens / usage, within a block.
    """
    response = await t.client.get(f"{t.url}/metrics", timeout=10)
    found = wire.cache_config(response.text) if response.status_code == 200 else None
    if found is not None:
        blocks, size = found
        return blocks * size, size, "vllm:cache_config_info"
    held = min(8192, max_model_len // 2)
    usage = await _usage_while_holding(t, _tokens(rng, held))
    if usage is None or usage <= 0:
        return None, None, "unknown (no vllm:cache_config_info, no usable vllm:kv_cache_usage_perc)"
    return int(round(held / usage)), None, f"vllm:kv_cache_usage_perc while holding {held} tokens"


async def _usage_while_holding(t: _Target, prompt: list[int]) -> float | None:
    content = t.body(prompt, 64, stream=True)
    usage: float | None = None
    async with t.client.stream("POST", f"{t.url}/v1/completions", content=content, headers=_JSON) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                metrics = await t.metrics()
                usage = None if metrics is None else metrics.get(wire.KV_USAGE)
                break  # leaving the block closes the stream: the engine aborts the request
    await t.wait_idle()
    return usage


async def _prefill_point(t: _Target, rng: random.Random, l_hist: int, l_incr: int, repeats: int) -> PrefillSample:
    runs: list[float] = []
    hits: list[float] = []
    for _ in range(repeats):
        history = _tokens(rng, l_hist)
        if l_hist:
            await t.complete(history)
        timed = await t.first_token(history + _tokens(rng, l_incr))
        runs.append(timed.seconds)
        hits.append(l_hist if timed.prefix_hits is None else timed.prefix_hits)
    hit = int(statistics.median(hits))
    return PrefillSample(l_hist=hit, l_incr=l_hist + l_incr - hit, seconds=statistics.median(runs), runs=runs)


async def _decode_point(
    t: _Target, rng: random.Random, batch: int, context: int, steady: int, max_tokens: int
) -> DecodeSample:
    """b concurrent streams; the gaps after the last stream's first token are pure decode steps."""
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(batch)]  # (time, completion tokens so far)
    window_start: list[int] | None = None
    enough = asyncio.Event()
    failure: list[str] = []

    def observe(i: int, now: float, count: int) -> None:
        nonlocal window_start
        arrivals[i].append((now, count))
        if window_start is None and all(arrivals):
            window_start = [len(a) for a in arrivals]  # each window begins with the next arrival
        if window_start is not None and all(
            len(a) - s >= steady + 1 for a, s in zip(arrivals, window_start, strict=True)
        ):
            enough.set()

    async def stream(i: int) -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        content = t.body(_tokens(rng, context), max_tokens, stream=True, stream_options=options)
        async with t.client.stream("POST", f"{t.url}/v1/completions", content=content, headers=_JSON) as r:
            if r.status_code != 200:
                failure.append(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                enough.set()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                usage = chunk.get("usage") or {}
                count = int(usage.get("completion_tokens") or (arrivals[i][-1][1] + 1 if arrivals[i] else 1))
                observe(i, now, count)
        if not enough.is_set():
            failure.append(f"a stream finished after {len(arrivals[i])} chunks, before the batch was steady")
            enough.set()

    tasks = [asyncio.create_task(stream(i)) for i in range(batch)]
    try:
        await enough.wait()
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await t.wait_idle()
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    if failure or errors:
        raise ProfilerError(f"decode batch {batch} x {context}: {failure or errors}")
    assert window_start is not None
    slopes, contexts = [], []
    for a, s in zip(arrivals, window_start, strict=True):
        (t0, n0), (t1, n1) = a[s], a[-1]
        slopes.append((t1 - t0) / (n1 - n0))
        # The step that produces token n reads c + n - 2 cached tokens (the sim's and
        # perfmodel.profile's convention: the tokens computed before the step).
        contexts.append(context + (n0 + 1 + n1) / 2 - 2)
    return DecodeSample(batch=batch, context=sum(contexts), seconds=statistics.median(slopes), prompt_tokens=context)


async def _transfer_point(
    decode: _Target, prefill: _Target, rng: random.Random, tokens: int, repeats: int
) -> tuple[float, float]:
    """(median hand-off TTFT, median T_pre(tokens - 1, 1)) on the decode engine, wall clock."""
    totals, recomputes = [], []
    for _ in range(repeats):
        prompt = _tokens(rng, tokens)
        params = (await prefill.complete(prompt, kv_transfer_params=wire.PREFILL_PARAMS)).get("kv_transfer_params")
        if not params:
            raise ProfilerError(f"{prefill.url} returned no kv_transfer_params (is it a NIXL kv_producer?)")
        totals.append((await decode.first_token(prompt, kv_transfer_params=params)).seconds)
        other = _tokens(rng, tokens)
        await decode.complete(other[:-1])
        recompute = await decode.first_token(other)
        if recompute.prefix_hits is not None and recompute.prefix_hits != tokens - 1:
            raise ProfilerError(
                f"T_pre({tokens - 1}, 1) hit {recompute.prefix_hits:.0f} cached tokens, not {tokens - 1}: "
                "transfer_tokens - 1 must be a multiple of the engine's block size"
            )
        recomputes.append(recompute.seconds)
    return statistics.median(totals), statistics.median(recomputes)


async def measure(
    url: str,
    *,
    prefill_url: str | None = None,
    grid: Grid = Grid(),
    speed: float = 1.0,
    progress: Progress | None = None,
    clock: Clock = "client",
    seed: int | None = None,
) -> Measurements:
    """Time the engine at ``url`` over ``grid`` (see the module docstring).

    ``prefill_url``, if given, is a prefill (NIXL kv_producer) worker of the same model
    and TP degree, used to time KV hand-offs into ``url``. ``speed``: the engine runs
    this many times faster than the GPU it models (GPU-free workers' ``--speed``);
    stored times are modelled seconds (measured x speed). ``clock``: ``"client"`` or
    ``"engine"``, whose clock times first tokens (module docstring). ``progress`` is
    called with one line per point; ``seed`` fixes the random prompts. The engines
    should serve nothing else meanwhile.
    """
    say = progress or (lambda _: None)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max(grid.decode_batch, default=1) + 16, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model, max_len = await _models(client, url)
        t = _Target(client, url, model, clock)
        await t.complete(_tokens(rng, 16))  # first-request costs are not the model's
        capacity, block_size, source = await _kv_capacity(t, rng, max_len)
        say(f"{model} at {url}: max_model_len {max_len}, KV capacity {capacity} tokens ({source})")
        m = Measurements(
            url=url,
            prefill_url=prefill_url,
            model_name=model,
            max_model_len=max_len,
            speed=speed,
            clock=clock,
            kv_capacity_tokens=capacity,
            kv_capacity_source=source,
            block_size=block_size,
            repeats=grid.repeats,
            measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )

        for l_hist in grid.prefill_hist:
            for l_incr in grid.prefill_incr:
                if l_hist + l_incr + 1 > max_len:
                    continue
                s = await _prefill_point(t, rng, l_hist, l_incr, grid.repeats)
                s = s.model_copy(update={"seconds": s.seconds * speed, "runs": [r * speed for r in s.runs]})
                m.prefill.append(s)
                say(f"prefill l_hist={s.l_hist} l_incr={s.l_incr}: {1e3 * s.seconds:.2f} ms")

        for batch in grid.decode_batch:
            for context in grid.decode_context:
                headroom = grid.steady_tokens + 4 + math.ceil(batch * context / grid.min_chunk_tokens)
                max_tokens = min(headroom, max_len - context)
                fits = capacity is None or batch * (context + max_tokens) <= 0.9 * capacity
                if max_tokens < grid.steady_tokens + 2 or not fits:
                    continue
                runs = [
                    await _decode_point(t, rng, batch, context, grid.steady_tokens, max_tokens)
                    for _ in range(grid.decode_repeats)
                ]
                s = DecodeSample(
                    batch=batch,
                    context=statistics.median(r.context for r in runs),
                    seconds=statistics.median(r.seconds for r in runs) * speed,
                    prompt_tokens=context,
                )
                m.decode.append(s)
                say(f"decode b={batch} context={s.context:.0f}: {1e3 * s.seconds:.2f} ms/step")

        if prefill_url is not None:
            p_model, p_len = await _models(client, prefill_url)
            p = _Target(client, prefill_url, p_model, clock)
            await p.complete(_tokens(rng, 16))
            for tokens in grid.transfer_tokens:
                if tokens + 1 > min(max_len, p_len):
                    continue
                total, recompute = await _transfer_point(t, p, rng, tokens, grid.repeats)
                s = TransferSample(
                    tokens=tokens,
                    seconds=(total - recompute) * speed,
                    total_seconds=total * speed,
                    recompute_seconds=recompute * speed,
                )
                m.transfer.append(s)
                say(f"KV transfer of {tokens} tokens: {1e3 * s.seconds:.2f} ms")
        gaps = [x.client_s - x.engine_s for x in t.timings if x.engine_s is not None]
        if gaps:
            m.api_overhead_seconds = statistics.median(gaps) * speed
    return m


async def profile_worker(
    url: str,
    *,
    prefill_url: str | None = None,
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int = 1,
    speed: float = 1.0,
    out_path: Path,
    grid: Grid = Grid(),
    progress: Progress | None = None,
    clock: Clock = "client",
    measurements_out: Path | None = None,
) -> tuple[Profile, FitReport]:
    """Measure the engine at ``url``, fit a profile, and write it to ``out_path``.

    The engine speaks vLLM's OpenAI HTTP API (vLLM, or ``ampd worker sim``) and should
    serve nothing else while it is measured. Options:

    * ``prefill_url``: a prefill worker (NIXL kv_producer) of the same model and TP;
      with it the KV hand-off into ``url`` is timed and kv_transfer fitted, without it
      kv_transfer is the roofline's for ``gpu``;
    * ``model``, ``gpu``, ``tp``: what the engine runs (they go into the profile and give
      the bytes of KV per token, so T_kv is fitted on bytes per link);
    * ``speed``: how many times faster than the modelled GPU the engine runs (a GPU-free
      worker's ``--speed``; 1 for real hardware);
    * ``out_path``: the profile file; its stem is the profile's name (so
      ``planner/profiles/<name>.json`` is loadable by name);
    * ``grid``: the sample points (:class:`Grid`);
    * ``progress``: called with one line per measured point;
    * ``clock``: ``"client"`` (default) times first tokens at the client, so HTTP and
      API-server overhead becomes part of the fitted constants; ``"engine"`` uses the
      engine's own TTFT histogram instead (vLLM and the GPU-free engine export it);
    * ``measurements_out``: also write the raw samples there (JSON).

    The KV capacity is the engine's own (``vllm:cache_config_info``, or probed through
    ``vllm:kv_cache_usage_perc``), else the memory model's estimate. Returns the profile
    and the fit's report (see :func:`report_table`).
    """
    m = await measure(url, prefill_url=prefill_url, grid=grid, speed=speed, progress=progress, clock=clock)
    if measurements_out is not None:
        measurements_out.write_text(m.model_dump_json(indent=2) + "\n")
    capacity = m.kv_capacity_tokens
    if capacity is None:
        capacity = modelled_kv_capacity(model, gpu, tp, MemoryPlan())
        m = m.model_copy(update={"kv_capacity_source": "perfmodel.memory's estimate (the engine reported none)"})
    profile, report = fit(m, model=model, gpu=gpu, tp=tp, kv_capacity_tokens=capacity, name=out_path.stem)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    profile.dump(out_path)
    return profile, report


__all__ = [
    "DecodeSample",
    "FitReport",
    "Grid",
    "Measurements",
    "PieceFit",
    "PrefillSample",
    "ProfilerError",
    "TransferSample",
    "fit",
    "geometric_knots",
    "hinge_columns",
    "hinge_to_piecewise",
    "measure",
    "profile_worker",
    "report_table",
    "roofline_kv_transfer",
    "slopes_to_piecewise",
]
