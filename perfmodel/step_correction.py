"""A profile's step times corrected online by the steps an engine actually ran.

A profile is measured once, on one machine, one day, one build of the engine; the engine
that reads it runs on another. Step sizing (DynaServe: "Unified and Elastic Execution for
Dynamic Disaggregated LLM Serving", section 4.2, Alg. 2) prices each step with it, so a
profile that says a step takes twice what it does leaves half of every step's budget
unused, and one that says half makes every step overrun the ITL SLO. The engine knows
both sides of each step - what the profile predicted when it scheduled it and what it
took - so it corrects the prices as it runs:

* **A factor per step shape**, measured / predicted. A step that only decodes (fixed
  per-step cost, KV reads) and one that carries prefill are mispriced by different
  amounts when the engine differs from the profile's (another build, eager against
  compiled, another CPU); and a prefill's attention over a long history by another
  amount again, so prefill steps are told apart by the history their prefill starts at,
  in octaves (:func:`shape_of`). A factor scales the whole step's time at one history,
  which keeps it monotone in the prefill's tokens: the step sizer's bisection still holds.
  A shape not yet seen enough takes the factor of all prefill steps.
* **A quantile of the last WINDOW log-ratios, QUANTILE by default**: a step target bounds
  the streams' tail gap, and a price at the median ratio lets half of the steps overrun
  it; at the ninth decile nine in ten fit, and the steps still fill most of the target.
  An order statistic, not a mean: robust to the outlier steps an engine has (a pause for
  garbage collection, a neighbour process taking the core), and following a drift within
  a window's steps.
* **Bounded** to [1/MAX_FACTOR, MAX_FACTOR], and the profile's own price until MIN_STEPS
  of a shape were seen: a few odd steps, or a clock misread, never make a step's budget
  vanish or unbounded.
* Steps predicted under MIN_PREDICTED_S are not taken: their ratio is the clock's noise.

Pure: events in (``observe``), the factor out. ampd's scheduler inside vLLM
(workers.vllm.step_sizing) calls it on every step; its supervisor publishes the factor of
all prefill steps in the registry (``WorkerInfo.prefill_factor``), and gateways price the
engine's prefills with it (rounds.routing.WorkerView): AMPD's Eq. 1-2 and the reordering's
estimates ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 3)
then use the costs the engine itself found.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

DECODE, PREFILL = "decode", "prefill"  # the shapes; PREFILL is also every prefill step together
WINDOW = 64
MIN_STEPS = 8
QUANTILE = 0.9
MAX_FACTOR = 4.0
MIN_PREDICTED_S = 1e-4
FIRST_OCTAVE = 512  # prefill histories below it are one shape


def shape_of(prefill_tokens: int, history: int = 0) -> str:
    """A step's shape: ``decode``, or ``prefill@H`` with H the octave of the history its
    prefill starts at (0 below FIRST_OCTAVE, then 512, 1024, 2048, ...)."""
    if prefill_tokens <= 0:
        return DECODE
    octave = 0 if history < FIRST_OCTAVE else FIRST_OCTAVE << int(math.log2(history / FIRST_OCTAVE))
    return f"{PREFILL}@{octave}"


@dataclass
class StepCorrection:
    """measured / predicted step time per shape, from the last ``window`` steps of each."""

    window: int = WINDOW
    min_steps: int = MIN_STEPS
    quantile: float = QUANTILE
    seen: dict[str, int] = field(default_factory=dict)
    _log_ratios: dict[str, deque[float]] = field(default_factory=dict, repr=False)
    _factors: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_steps <= self.window or not 0 < self.quantile < 1:
            raise ValueError(f"need 1 <= min_steps <= window and 0 < quantile < 1, got {self.min_steps}, "
                             f"{self.window} and {self.quantile}")  # fmt: skip

    def observe(self, shape: str, predicted_s: float, measured_s: float) -> None:
        """One step the engine ran: its shape, the profile's (uncorrected) price and its time."""
        if predicted_s < MIN_PREDICTED_S or measured_s <= 0 or not math.isfinite(measured_s):
            return
        ratio = math.log(measured_s / predicted_s)
        for key in {shape, PREFILL} if shape != DECODE else {DECODE}:
            ratios = self._log_ratios.setdefault(key, deque(maxlen=self.window))
            ratios.append(ratio)
            self.seen[key] = self.seen.get(key, 0) + 1
            if len(ratios) >= self.min_steps:
                bound = math.log(MAX_FACTOR)
                level = float(np.quantile(ratios, self.quantile))
                self._factors[key] = math.exp(min(bound, max(-bound, level)))

    def factor(self, shape: str) -> float:
        """What the profile's time for a step of ``shape`` is multiplied by to be the engine's."""
        fallback = self._factors.get(PREFILL, 1.0) if shape != DECODE else 1.0
        return self._factors.get(shape, fallback)

    def factors(self) -> dict[str, float]:
        return dict(self._factors)
