"""The elastic controller: which role each engine takes as the load moves. Pure: no I/O.

Events in, moves out: the live gateway (one replica at a time) and the simulator feed
it the same observations - every ``interval_s`` the engines' state, every
``forecast_interval_s`` the demand of the interval that ended - and apply the
``Move``s it returns (rounds.roles). Two sources of moves, each an ablation alone:

* **Arrow** ("Arrow: Adaptive Scheduling Mechanisms for Disaggregated LLM Inference
  Architecture", section 5.5, Alg. 3-4), moves driven by the SLO as it is being met:
  when no prefill engine can start a typical round within alpha x TTFT_thres (Alg. 1's
  predicted TTFT: its queued prefill seconds plus the round's T_pre) and decode is not
  loaded, a decode engine moves to prefill (Alg. 3: from the P->D pool first, else the
  one decoding least, never the last decode engine); when decode misses its ITL
  threshold (the windowed mean gap, Arrow's "average token generation interval") or
  runs out of KV, a prefill engine moves to decode (Alg. 4: D->P first, else the one
  with the least queued). Under overload on both sides decode goes first (section 5.5:
  a prefill move checks decode load, a decode move does not check prefill's).
* **DOPD** ("DOPD: A Dynamic PD-Disaggregation Architecture for Maximizing Goodput in
  LLM Inference Serving", section IV, Alg. 2), moves ahead of the load: every
  ``forecast_interval_s`` an ARIMA forecast (statsmodels) of the next interval's round
  rate, prefill tokens, output tokens and context gives a target split, and the pool
  moves one engine at a time towards it. DOPD's target balances the two phases,
  n_p / n_d = cc_d x t_p / (t_d x OSL) (Eq. 14; cc_d the concurrency a decode engine
  holds within its KV and the ITL SLO, Eq. 11-13; t_p a round's prefill, t_d a decode
  step at cc_d, from the engines' profiles). Under AMPD's routing that balance is not
  the best split - decode engines prefill incremental rounds themselves, and whether
  they should depends on how the ITL SLO judges their stalls - so where the planner
  has simulated the pool (a ``RolePlan``: the best split at each load, planner.role_plan)
  the forecast rate picks the planned split instead; Eq. 14 is the fallback. DOPD's
  emergency scaling (Alg. 2, lines 18-23: prefill queue depth, KV occupancy) moves at
  once when the prefill queues hold more than TTFT_thres of work or decode KV is nearly
  full.

Neither paper bounds how often an engine may flip; here an engine keeps a role for at
least ``min_dwell_s`` and the pool makes one move per ``cooldown_s``, so roles do not
flap. A move costs no restart (rounds.roles); what it does cost - the moved engine's
running work drains, and the sessions that lose their decode engine pull their KV over
NIXL at their next round - is paid by the live system and modelled by the simulator.
DOPD's ultra-short local prefills and AMPD's local incremental prefills are the
routing's (AMPD's Alg. 1 within the current roles), not the controller's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from perfmodel.profile import Profile
from perfmodel.slo import ALPHA, BETA, SLO
from rounds.roles import Assignment, Role


@dataclass(frozen=True)
class ElasticConfig:
    arrow: bool = True  # SLO-driven moves (Arrow)
    dopd: bool = True  # forecast-driven split and emergency moves (DOPD)
    planned: bool = True  # the forecast picks the planner's split (a RolePlan), where one is given
    interval_s: float = 1.0  # how often the controller looks at the engines
    forecast_interval_s: float = 30.0  # DOPD's T: how often demand is forecast
    min_dwell_s: float = 20.0  # an engine keeps a role at least this long
    cooldown_s: float = 5.0  # the pool makes at most one move this often
    kv_busy: float = 0.9  # decode KV usage that counts as overload (DOPD's KV_CAP)
    kv_low: float = 0.6  # decode KV usage below which decode may lend an engine (with ITL slack)
    min_decode: int = 1  # engines that keep decoding whatever happens (Arrow's guard)
    history: int = 20  # intervals of demand the forecast is fitted on


@dataclass(frozen=True, slots=True)
class EngineState:
    """One engine as the controller sees it at a tick."""

    assignment: Assignment
    profile: Profile
    speed: float = 1.0
    queue_cost_s: float = 0.0  # estimated prefill seconds queued on it (wall clock)
    decoding: int = 0  # rounds decoding on it
    kv_usage: float = 0.0  # 0..1
    windowed_itl: float | None = None  # mean gap of its decodes over the statistics window

    @property
    def worker_id(self) -> str:
        return self.assignment.worker_id


@dataclass(frozen=True, slots=True)
class Demand:
    """What the rounds of one interval asked for (means over the interval's rounds)."""

    rounds_per_s: float  # rounds arriving: the load offered (finished rounds understate it under overload)
    prefill_tokens: float  # prompt tokens a round's prefill computes (the rest is cached)
    output_tokens: float
    context_tokens: float  # the conversation a round decodes after

    @classmethod
    def of(
        cls, seconds: float, rounds: int = 0, prefill: int = 0, context: int = 0, finished: int = 0, output: int = 0
    ) -> Demand:
        """One interval's counts: ``rounds`` arrived with ``prefill`` tokens to compute and
        ``context`` tokens of prompt; ``finished`` rounds gave ``output`` tokens."""
        output_mean = output / max(finished, 1)
        per = max(rounds, 1)
        return cls(rounds / seconds, prefill / per, output_mean, context / per + output_mean)


@dataclass(frozen=True, slots=True)
class RoleStep:
    """One load the planner simulated, and the SLO attainment of each split it tried there."""

    rounds_per_s: float
    attainment: dict[int, float]  # engines in the prefill role -> SLO attainment

    @property
    def best(self) -> int:
        return max(self.attainment, key=lambda k: (self.attainment[k], -k))


@dataclass(frozen=True, slots=True)
class RolePlan:
    """The planner's splits of one pool by load (planner.role_plan), steps by rising load.

    A move costs - the engine's running work drains, and the sessions it decoded pull
    their KV elsewhere at their next round - so the pool changes its split only for a
    planned gain of more than ``margin`` per engine moved."""

    steps: tuple[RoleStep, ...]
    margin: float = 0.05

    def __post_init__(self) -> None:
        if not self.steps or any(not s.attainment or min(s.attainment) < 0 for s in self.steps):
            raise ValueError("a role plan needs steps, each with the attainment of one split at least")
        if any(a.rounds_per_s >= b.rounds_per_s for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError("a role plan's steps go by rising load")

    def attainment(self, rounds_per_s: float) -> dict[int, float]:
        """Each split's planned attainment at ``rounds_per_s``: linear between the loads
        planned (so that a forecast's noise moves it a little, not a step), the nearest
        load's beyond them; splits planned at only one of two loads are left out between."""
        steps = self.steps
        if rounds_per_s <= steps[0].rounds_per_s:
            return dict(steps[0].attainment)
        if rounds_per_s >= steps[-1].rounds_per_s:
            return dict(steps[-1].attainment)
        hi = next(i for i, s in enumerate(steps) if s.rounds_per_s >= rounds_per_s)
        lo, up = steps[hi - 1].attainment, steps[hi].attainment
        x = (rounds_per_s - steps[hi - 1].rounds_per_s) / (steps[hi].rounds_per_s - steps[hi - 1].rounds_per_s)
        return {k: lo[k] + x * (up[k] - lo[k]) for k in lo if k in up}

    def target(self, rounds_per_s: float, current: int | None = None) -> int:
        """The best split at ``rounds_per_s`` that gains more than ``margin`` per engine it
        moves over ``current`` (the best one outright without a current split)."""
        here = self.attainment(rounds_per_s)
        if current not in here:
            return max(here, key=lambda k: (here[k], -k))
        gain = {k: here[k] - here[current] - self.margin * abs(k - current) for k in here}
        best = max(gain, key=lambda k: (gain[k], -abs(k - current)))
        return best if gain[best] > 0 else current


@dataclass(frozen=True, slots=True)
class Move:
    worker_id: str
    role: Role
    reason: str


def decode_concurrency(profile: Profile, context: float, itl_s: float) -> int:
    """DOPD's cc_d (Eq. 11-13): the rounds one decode engine holds at once - within its KV
    cache, and within the ITL threshold per step."""
    by_memory = int(profile.kv_capacity_tokens / max(context, 1.0))
    batch = 1
    while batch < by_memory and profile.t_dec(batch * 2, batch * 2 * context) <= itl_s:
        batch *= 2
    return max(1, min(by_memory, batch))


def balanced_split(demand: Demand, prefill: Profile, decode: Profile, engines: int, slo: SLO, min_decode: int) -> int:
    """Prefill engines out of ``engines`` that balance the two phases for ``demand``:
    n_p = rate x t_p engines' worth of prefill, n_d = rate x OSL x t_d / cc_d of decode
    (their ratio is DOPD's Eq. 14), scaled to the pool."""
    context = max(demand.context_tokens, 1.0)
    cc = decode_concurrency(decode, context, slo.itl_s)
    t_p = prefill.t_pre(0, max(1, round(demand.prefill_tokens)))
    t_d = decode.t_dec(cc, round(cc * context))
    need_p = demand.rounds_per_s * t_p
    need_d = demand.rounds_per_s * demand.output_tokens * t_d / cc
    if need_p + need_d <= 0:
        return 0
    return min(max(0, round(engines * need_p / (need_p + need_d))), engines - min_decode)


def forecast(series: Sequence[float]) -> float:
    """The next value of ``series``: ARIMA(1,1,0) fitted by statsmodels (DOPD leaves the
    order open; one difference follows a ramp), the last value while the series is short
    or the fit fails."""
    if len(series) < 6 or len(set(series)) == 1:
        return series[-1]
    from statsmodels.tsa.arima.model import ARIMA

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = ARIMA(list(series), order=(1, 1, 0)).fit()
        value = float(result.forecast(1)[0])
    except (ValueError, ArithmeticError, RuntimeError):
        return series[-1]
    return value if math.isfinite(value) and value >= 0 else series[-1]


@dataclass
class ElasticController:
    config: ElasticConfig
    slo: SLO
    alpha: float = ALPHA  # Alg. 1's TTFT slack factor, the budget a prefill must start within
    beta: float = BETA  # Alg. 1's ITL slack factor, decode's "low load"
    plan: RolePlan | None = None  # the planner's splits by load (used where config.planned)
    demand: list[Demand] = field(default_factory=list)
    target_prefill: int | None = None  # the split for the forecast load
    last_move: float = -math.inf
    last_role: Role | None = None  # the role the last move gave

    @property
    def planned(self) -> RolePlan | None:
        return self.plan if self.config.planned else None

    # -- events in -----------------------------------------------------------------------
    def observe(self, demand: Demand, engines: Sequence[EngineState]) -> None:
        """An interval of demand ended: forecast the next and set the target split."""
        self.demand = [*self.demand, demand][-self.config.history :]
        if not self.config.dopd or not engines:
            return
        ahead = Demand(*(forecast([getattr(d, f.name) for d in self.demand]) for f in fields(Demand)))
        most = len(engines) - self.config.min_decode
        if self.planned is not None:
            now = sum(1 for e in engines if e.assignment.role == "prefill")
            self.target_prefill = min(self.planned.target(ahead.rounds_per_s, now), most)
            return
        prefill = next((e.profile for e in engines if e.assignment.role == "prefill"), engines[0].profile)
        decode = next((e.profile for e in engines if e.assignment.binds), engines[0].profile)
        self.target_prefill = balanced_split(ahead, prefill, decode, len(engines), self.slo, self.config.min_decode)

    # -- moves out -----------------------------------------------------------------------
    def tick(self, now: float, engines: Sequence[EngineState]) -> list[Move]:
        """At most one move (``cooldown_s``), of an engine that kept its role ``min_dwell_s``;
        a move back the way the last one went waits ``min_dwell_s`` too, unless decode's KV
        is full - so that two triggers cannot pass an engine back and forth."""
        if now - self.last_move < self.config.cooldown_s:
            return []
        chosen = self._decide(now, engines)
        if chosen is None:
            return []
        reverses = self.last_role is not None and chosen.role != self.last_role
        if reverses and now - self.last_move < self.config.min_dwell_s and chosen.reason != "decode-kv":
            return []
        self.last_move, self.last_role = now, chosen.role
        return [chosen]

    def _decide(self, now: float, engines: Sequence[EngineState]) -> Move | None:
        prefills = [e for e in engines if e.assignment.role == "prefill"]
        decodes = [e for e in engines if e.assignment.binds]
        movable = [e for e in engines if now - e.assignment.since >= self.config.min_dwell_s]
        to_prefill = [e for e in decodes if e in movable] if len(decodes) > self.config.min_decode else []
        to_decode = [e for e in prefills if e in movable]
        itl_over, decode_low, prefill_over = self._pressure(prefills, decodes)
        if self._kv_full(decodes):  # decode first (Arrow 5.5; DOPD's KV emergency)
            return self._to_decode(to_decode, "decode-kv")
        if self.config.arrow and self.planned is None:  # the plan's splits already price these
            if itl_over:
                return self._to_decode(to_decode, "decode-slo")
            if prefill_over and decode_low:
                return self._to_prefill(to_prefill, "prefill-slo")
        if not self.config.dopd:
            return None
        if self.planned is None and self._queue_full(prefills) and decode_low:  # DOPD's queue emergency
            return self._to_prefill(to_prefill, "prefill-queue")
        if self.target_prefill is None:
            return None
        if len(prefills) < self.target_prefill and (decode_low or self.planned is not None):
            return self._to_prefill(to_prefill, "forecast")
        if len(prefills) > self.target_prefill:
            return self._to_decode(to_decode, "forecast")
        return None

    def _pressure(self, prefills: list[EngineState], decodes: list[EngineState]) -> tuple[bool, bool, bool]:
        """Decode over its ITL threshold (Arrow's average token interval), decode at ease
        (within beta of it, KV below ``kv_low``), and prefill late (Alg. 1's predicted TTFT
        of a typical round on the least loaded prefill engine over alpha x TTFT_thres)."""
        itl_over = any((e.windowed_itl or 0.0) > self.slo.itl_s for e in decodes)
        decode_low = all(
            (e.windowed_itl or 0.0) <= self.beta * self.slo.itl_s and e.kv_usage < self.config.kv_low for e in decodes
        )
        tokens = self.demand[-1].prefill_tokens if self.demand else 1024.0
        budget = self.alpha * self.slo.ttft_s
        serving = prefills or decodes  # without prefill engines every prefill runs on the decode engines
        start = min((e.queue_cost_s + e.profile.t_pre(0, round(tokens)) / e.speed for e in serving), default=0.0)
        return itl_over, decode_low, start > budget

    def _kv_full(self, decodes: list[EngineState]) -> bool:
        return any(e.kv_usage > self.config.kv_busy for e in decodes)

    def _queue_full(self, prefills: list[EngineState]) -> bool:
        return sum(e.queue_cost_s for e in prefills) > self.slo.ttft_s

    def _to_decode(self, candidates: list[EngineState], reason: str) -> Move | None:
        """Alg. 4: a prefill engine still draining decodes first, else the least queued."""
        if not candidates:
            return None
        chosen = min(candidates, key=lambda e: (e.assignment.draining != "decode", e.queue_cost_s, e.worker_id))
        return Move(chosen.worker_id, "decode", reason)

    def _to_prefill(self, candidates: list[EngineState], reason: str) -> Move | None:
        """Alg. 3: a decode engine still draining prefills first, else the one decoding least."""
        if not candidates:
            return None
        chosen = min(candidates, key=lambda e: (e.assignment.draining != "prefill", e.decoding, e.worker_id))
        return Move(chosen.worker_id, "prefill", reason)
