"""Published measurements the performance model is checked against.

DOPD ("DOPD: A Dynamic PD-Disaggregation Architecture for Maximizing Goodput in LLM
Inference Serving", section II, Table I): Llama-3.3-70B-FP8 on one H100, prefill time
of one request and decode step time at 104, 200 and 248 concurrent sequences, for
sequence lengths 100 to 1700.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfmodel.profile import Profile

DOPD_PREFILL_MS = {100: 36, 200: 46, 700: 125, 1200: 193, 1700: 269}
DOPD_DECODE_MS = {  # sequence length -> {concurrency: step ms}
    100: {104: 28, 200: 45, 248: 47},
    200: {104: 31, 200: 46, 248: 49},
    700: {104: 33, 200: 47, 248: 53},
    1200: {104: 35, 200: 50, 248: 57},
    1700: {104: 37, 200: 53, 248: 61},
}


@dataclass(frozen=True)
class Comparison:
    what: str
    measured_s: float
    predicted_s: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def compare_dopd_table_i(profile: Profile) -> list[Comparison]:
    """The profile's T_pre and T_dec next to every cell of DOPD Table I."""
    rows = [Comparison(f"prefill {n} tokens", ms / 1e3, profile.t_pre(0, n)) for n, ms in DOPD_PREFILL_MS.items()]
    for n, by_batch in DOPD_DECODE_MS.items():
        rows += [
            Comparison(f"decode step, {b} x {n} tokens", ms / 1e3, profile.t_dec(b, b * n))
            for b, ms in by_batch.items()
        ]
    return rows
