"""Service-level objectives: the TTFT and ITL thresholds a round is judged against.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving", section 7.1) reports SLO attainment; as in
DistServe, a threshold is a scale times the unloaded latency of the model on its
hardware: TTFT_thres = scale * T_pre(0, reference prompt), ITL_thres = scale *
T_dec(1, reference context). Explicit thresholds override the derived ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfmodel.profile import Profile

REFERENCE_PROMPT_TOKENS = 1024
DEFAULT_SCALE = 5.0


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float

    def scaled(self, speed: float) -> SLO:
        """The same objective for an engine running ``speed`` times faster than modelled."""
        return SLO(self.ttft_s / speed, self.itl_s / speed)


def derived_slo(profile: Profile, scale: float = DEFAULT_SCALE, prompt_tokens: int = REFERENCE_PROMPT_TOKENS) -> SLO:
    """``prompt_tokens`` is the request the latencies are measured on: a workload's typical
    round when thresholds are set per workload, as DistServe does."""
    unloaded_ttft = profile.t_pre(0, prompt_tokens)
    unloaded_itl = profile.t_dec(1, prompt_tokens)
    return SLO(scale * unloaded_ttft, scale * unloaded_itl)
