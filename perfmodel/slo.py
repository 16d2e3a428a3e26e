"""Service-level objectives: the TTFT and ITL thresholds a round is judged against, and how.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 7.1)
reports SLO attainment; as in DistServe, a threshold is a scale times the unloaded
latency of the model on its hardware: TTFT_thres = scale * T_pre(0, reference prompt),
ITL_thres = scale * T_dec(1, reference context). Explicit thresholds override the
derived ones.

A round meets its SLO when its TTFT is within TTFT_thres and its inter-token gaps are
within ITL_thres by one of three rules (the ITL rule, ``ItlRule``):

* ``mean`` - the mean gap (TPOT; DistServe's and the AMPD paper's rule);
* ``p95`` - the 95th percentile of its gaps, nearest rank (the tail rule; Sarathi-Serve
  judges the 99th percentile of time between tokens);
* ``max`` - its longest gap: the worst stall its user saw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from perfmodel.profile import Profile

REFERENCE_PROMPT_TOKENS = 1024
DEFAULT_SCALE = 5.0
ItlRule = Literal["mean", "p95", "max"]
ITL_RULES: tuple[ItlRule, ...] = get_args(ItlRule)


@dataclass(frozen=True, slots=True)
class Gaps:
    """A round's inter-token gaps, summarised (seconds; None without gaps)."""

    count: int = 0
    total_s: float = 0.0
    p95_s: float | None = None
    max_s: float | None = None

    @classmethod
    def of(cls, gaps: Sequence[float], total_s: float | None = None) -> Gaps:
        """``total_s``: their sum where the caller kept it another way (a simulated round's
        span of token times), so that its mean stays exactly what it was."""
        if not gaps:
            return cls()
        ordered = sorted(gaps)
        total = sum(gaps) if total_s is None else total_s
        return cls(len(ordered), total, ordered[math.ceil(0.95 * len(ordered)) - 1], ordered[-1])

    @property
    def mean_s(self) -> float | None:
        return self.total_s / self.count if self.count else None

    def by(self, rule: ItlRule) -> float | None:
        """The round's ITL as ``rule`` reads it."""
        return {"mean": self.mean_s, "p95": self.p95_s, "max": self.max_s}[rule]


# Alg. 1's slack factors (AMPD, "Efficient Multi-round LLM Inference over Disaggregated
# Serving", section 4.2): a prefill must start within ALPHA x the TTFT SLO, and a decode
# engine counts as lightly loaded below BETA x the ITL SLO. The defaults of every layer.
ALPHA = 0.9
BETA = 0.85


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float

    def scaled(self, speed: float) -> SLO:
        """The same objective for an engine running ``speed`` times faster than modelled."""
        return SLO(self.ttft_s / speed, self.itl_s / speed)

    def met(self, ttft_s: float | None, itl_s: float | None) -> bool:
        """Whether a round with this TTFT and this ITL (by whichever rule: ``Gaps.by``) meets
        the objective; a round without gaps is judged by its TTFT alone, one without a token misses."""
        return ttft_s is not None and ttft_s <= self.ttft_s and (itl_s is None or itl_s <= self.itl_s)


def derived_slo(profile: Profile, scale: float = DEFAULT_SCALE, prompt_tokens: int = REFERENCE_PROMPT_TOKENS) -> SLO:
    """``prompt_tokens`` is the request the latencies are measured on: a workload's typical
    round when thresholds are set per workload, as DistServe does."""
    unloaded_ttft = profile.t_pre(0, prompt_tokens)
    unloaded_itl = profile.t_dec(1, prompt_tokens)
    return SLO(scale * unloaded_ttft, scale * unloaded_itl)
