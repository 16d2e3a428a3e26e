"""The roofline's efficiencies and fixed step overhead, fitted jointly to measurements.

The shipped constants (perfmodel.roofline.HOPPER_EFFICIENCY) were chosen to fit DOPD's
Table I alone ("DOPD: A Dynamic PD-Disaggregation Architecture for Maximizing Goodput in
LLM Inference Serving", section II): one engine's end-to-end step times, in which GEMM
efficiency, HBM efficiency and the engine's per-step overhead cannot be told apart. Kernel
timings (planner.profiler.kernels: a model's layers timed on a GPU with PyTorch, CUDA
graphs, no engine around them) price the kernels alone. Fitting both at once keeps the
engine's overhead apart from kernel time: it applies to DOPD's steps only.

What each source can say, and so what is fitted to it:

* kernel prefills of at least ``MIN_KERNEL_PREFILL`` tokens: cuBLAS GEMMs and fused
  attention, the kernels an engine runs for them too - the BF16 GEMM efficiency
  (``compute``) and attention's;
* DOPD's Table I (FP8 weights, vLLM on an H100): the FP8 GEMM efficiency
  (``compute_fp8``), HBM bandwidth (``memory``) and the step overhead;
* kernel decode steps are compared, not fitted: PyTorch runs a small batch's GEMMs as
  GEMVs and its attention splits no sequence's KV across thread blocks, where vLLM's
  kernels do, so they are slower than an engine's own at small batches.

The fit minimises squared log errors (a ratio is what matters), within bounds that keep
each figure physical: attention at most ``MAX_ATTENTION`` of peak (FlashAttention-3's
forward pass at its best), HBM at most ``MAX_MEMORY`` of its datasheet bandwidth.
Pure: measurements in, an Efficiency and the errors out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from perfmodel.catalog import GPUS, MODELS
from perfmodel.profile import Efficiency
from perfmodel.published import DOPD_DECODE_MS, DOPD_PREFILL_MS
from perfmodel.roofline import (
    HOPPER_EFFICIENCY,
    context_read_seconds_per_token,
    forward_kernel_seconds,
    prefill_attention_seconds_per_pair,
)
from perfmodel.specs import GPUSpec, ModelSpec

MIN_KERNEL_PREFILL = 256  # tokens: shorter prefills stream weights, as decode does
MAX_ATTENTION = 0.75
MAX_MEMORY = 0.90
DOPD_MODEL, DOPD_GPU = "llama-3.3-70b-fp8", "H100"
FITTED = ("compute", "compute_fp8", "attention", "memory", "step_overhead_s")
_LOWER = (0.05, 0.05, 0.05, 0.05, 0.0)
_UPPER = (1.0, 1.0, MAX_ATTENTION, MAX_MEMORY, 0.05)


@dataclass(frozen=True)
class Point:
    """One measured step and how the roofline prices it under an efficiency."""

    source: str  # "kernels: <file>" or "DOPD Table I"
    what: str
    measured_s: float
    price: Callable[[Efficiency], float]
    fitted: bool  # whether the fit reads it (else it is only compared)

    def error(self, eff: Efficiency) -> float:
        return self.price(eff) / self.measured_s - 1


def _kernel_prefill(model: ModelSpec, gpu: GPUSpec, tp: int, n: int) -> Callable[[Efficiency], float]:
    pairs = n * (n + 1) / 2
    return lambda e: (
        forward_kernel_seconds(model, gpu, tp, e, n) + pairs * prefill_attention_seconds_per_pair(model, gpu, tp, e)
    )


def _kernel_decode(model: ModelSpec, gpu: GPUSpec, tp: int, batch: int, context: int) -> Callable[[Efficiency], float]:
    return lambda e: (
        forward_kernel_seconds(model, gpu, tp, e, batch)
        + batch * context * context_read_seconds_per_token(model, gpu, tp, e)
    )


def kernel_points(document: dict[str, Any], label: str) -> list[Point]:
    """The points of one kernel measurement (``ampd profile kernels --out``: the raw timings
    with ``model`` and ``roofline_gpu``), each priced without overhead or all-reduces."""
    model, gpu, tp = MODELS[document["model"]], GPUS[document["roofline_gpu"]], int(document.get("tp", 1))
    out = []
    for p in (p for p in document["prefill"] if "seconds" in p):
        n = int(p["tokens"])
        out.append(Point(f"kernels: {label}", f"prefill {n}", p["seconds"], _kernel_prefill(model, gpu, tp, n),
                         fitted=n >= MIN_KERNEL_PREFILL))  # fmt: skip
    for d in (d for d in document["decode"] if "seconds" in d):
        b, c = int(d["batch"]), int(d["context"])
        out.append(Point(f"kernels: {label}", f"decode b={b} c={c}", d["seconds"],
                         _kernel_decode(model, gpu, tp, b, c), fitted=False))  # fmt: skip
    return out


def dopd_points() -> list[Point]:
    """DOPD's Table I, each cell priced as a whole engine step (overhead included)."""
    model, gpu = MODELS[DOPD_MODEL], GPUS[DOPD_GPU]
    out = []
    for n, ms in DOPD_PREFILL_MS.items():
        price = _kernel_prefill(model, gpu, 1, n)
        out.append(Point("DOPD Table I", f"prefill {n}", ms / 1e3, lambda e, p=price: e.step_overhead_s + p(e), True))
    for n, by_batch in DOPD_DECODE_MS.items():
        for b, ms in by_batch.items():
            price = _kernel_decode(model, gpu, 1, b, n)
            out.append(Point("DOPD Table I", f"decode {b} x {n}", ms / 1e3,
                             lambda e, p=price: e.step_overhead_s + p(e), True))  # fmt: skip
    return out


@dataclass(frozen=True)
class SourceError:
    source: str
    fitted: bool  # the source's fitted points, or those only compared
    points: int
    mean_abs: float
    worst: float
    worst_what: str
    within_15: int


@dataclass(frozen=True)
class Calibration:
    efficiency: Efficiency
    before: list[SourceError]  # under the shipped constants
    after: list[SourceError]


def calibrate(points: Sequence[Point], start: Efficiency = HOPPER_EFFICIENCY) -> Calibration:
    """The efficiencies and overhead that price the fitted points best (module docstring)."""
    fitted = [p for p in points if p.fitted]
    if not fitted:
        raise ValueError("no point to fit")

    def efficiency(x: Sequence[float]) -> Efficiency:
        return start.model_copy(update=dict(zip(FITTED, map(float, x), strict=True)))

    x0 = [getattr(start, f) if getattr(start, f) is not None else start.compute for f in FITTED]
    x0 = [min(max(v, lo), hi) for v, lo, hi in zip(x0, _LOWER, _UPPER, strict=True)]
    result = least_squares(lambda x: [math.log1p(p.error(efficiency(x))) for p in fitted], x0, bounds=(_LOWER, _UPPER))
    best = efficiency(result.x)
    return Calibration(best, errors(points, start), errors(points, best))


def errors(points: Iterable[Point], eff: Efficiency) -> list[SourceError]:
    """Each source's relative errors under ``eff``, its fitted and its compared points apart:
    mean, worst, and points within 15%."""
    groups: dict[tuple[str, bool], list[Point]] = {}
    for p in points:
        groups.setdefault((p.source, p.fitted), []).append(p)
    out = []
    for (source, fitted), group in groups.items():
        errs = [p.error(eff) for p in group]
        worst = int(np.argmax(np.abs(errs)))
        out.append(SourceError(source, fitted, len(group), float(np.mean(np.abs(errs))), errs[worst],
                               group[worst].what, sum(abs(e) <= 0.15 for e in errs)))  # fmt: skip
    return out
