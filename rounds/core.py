"""The round core: what one round of a session decides and records. Pure: no I/O.

The live gateway (gateway.coordinator, gateway.rounds) and the simulator
(planner.simulator) both run every round through this module, so a simulated result
is a result of the live code. Events in, decisions out:

* :meth:`RoundCore.bind` - AMPD step 1: the decode worker a session's round runs on
  (kept while it serves, else placed by the placement rule: by memory as AMPD binds,
  rounds.binding, or by what the engines cache of the prompt, rounds.placement);
* :meth:`RoundCore.plan` - the round's prefill task, its route (the policy: AMPD's
  Alg. 1 or a baseline, rounds.policies) and its queue estimate (Eq. 1-2's t_pre on
  the routed worker, what that worker's prefill queue then holds);
* :meth:`RoundCore.pick` - which queued task a worker runs next (Alg. 2 or FIFO);
* :meth:`RoundCore.close` - what a finished round changes: the session's state, the
  observations for the windowed TTFT/ITL statistics, and the round's record.

State is plain frozen dataclasses the callers keep where they keep things (Redis and
the replica's memory live; the simulation's memory simulated).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from perfmodel.profile import Profile
from perfmodel.slo import ALPHA, BETA, ITL_RULES, SLO, Gaps, ItlRule
from rounds.binding import DecodeCandidate, choose_decode_worker
from rounds.placement import EngineLoad, Placement, PlacementContext, place
from rounds.policies import Policy, pick, route
from rounds.reordering import Decision, QueuedTask
from rounds.routing import PrefillTask, Route, RouteContext, WorkerView, local_compute, remote_compute


@dataclass(frozen=True, slots=True)
class SessionState:
    """What the engines hold of one session, as routing needs it."""

    decode_worker: str  # the worker bound to the session: it holds its KV and decodes its rounds
    l_hist: int = 0  # tokens of the session that worker holds (prompt + output so far)
    prefill_worker: str = ""  # the prefill worker of its last remote round ...
    prefill_cached: int = 0  # ... and the tokens of it in that worker's prefix cache
    rounds: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker a round could run on: who it is and what its profile predicts."""

    worker_id: str
    profile: Profile
    speed: float = 1.0  # a GPU-free worker may run this many times faster than the GPU it models
    block_size: int = 16  # tokens per KV block of its cache
    token_budget: int = 8192  # tokens it schedules per step (vLLM's max_num_batched_tokens)
    prefill_chunk: int = 0  # tokens of one request it prefills a step at most (0: all at once)
    colocates: bool = False  # its sessions' rounds all prefill on it (a mixed engine: rounds.roles)
    splits: bool = True  # it runs split requests (rounds.split_point)
    node: str = ""  # the server it sits on: KV moves over the server's interconnect within one ("": unknown)
    prefill_factor: float = 1.0  # its scheduler's correction of the profile's prefill prices (routing.WorkerView)


@dataclass(frozen=True)
class Signals:
    """The load signals read when a round starts: estimated seconds of prefill queued per
    worker, windowed means per (series, worker) (gateway.state.stats; series below), the
    prompt tokens of the prefills queued or running per worker, and for placement
    (rounds.placement) the round's prompt tokens each worker's prefix cache holds - as an
    index of the engines' KV events reports them; a worker absent holds what the
    session's state says - and its load in requests, counted as they are dispatched, not
    scraped: ``waiting``, the tasks in its prefill queue; ``running``, the rounds bound to
    it from their start until they close, and the remote prefills placed on it until they
    answer (gateway.state.round_ledger live, planner.simulator.gateway_side simulated)."""

    queue_costs: Mapping[str, float]
    means: Mapping[tuple[str, str], float]
    active_tokens: Mapping[str, int] = field(default_factory=dict)
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    waiting: Mapping[str, int] = field(default_factory=dict)
    running: Mapping[str, int] = field(default_factory=dict)

    def queue_cost(self, worker_id: str) -> float:
        # A worker that (re)joined since the signals were read has no queue yet.
        return max(0.0, self.queue_costs.get(worker_id, 0.0))

    def view(self, worker: Candidate, **kw: float | int | None) -> WorkerView:
        """``worker`` as routing sees it now."""
        return WorkerView(
            worker.worker_id, worker.profile, worker.speed, queue_cost=self.queue_cost(worker.worker_id),
            active_tokens=max(0, self.active_tokens.get(worker.worker_id, 0)), token_budget=worker.token_budget,
            prefill_chunk=worker.prefill_chunk, splits=worker.splits, node=worker.node,
            prefill_factor=worker.prefill_factor, **kw,
        )  # fmt: skip


# The windowed statistics' series (AMPD section 3: per-worker TTFT and ITL over the window).
TTFT_REMOTE = "ttft"  # per prefill worker, of remote rounds
TTFT_LOCAL = "ttft_local"  # per decode worker, of local rounds
ITL = "itl"  # per decode worker, (sum of gaps, number of gaps): a mean over tokens


def signal_series(worker_ids: Sequence[str]) -> list[tuple[str, str]]:
    """The (series, worker) means routing reads for these candidate workers."""
    return [(series, w) for w in worker_ids for series in (ITL, TTFT_REMOTE)]


@dataclass(frozen=True)
class Prompt:
    """A round's prompt as placement needs it: its length, the workers by id, and the
    signals read when it started."""

    l_total: int
    workers: Mapping[str, Candidate]
    signals: Signals


@dataclass(frozen=True, slots=True)
class RoundPlan:
    task: PrefillTask
    route: Route
    estimate_s: float  # t_pre on the routed worker, wall clock: what its prefill queue holds for it
    tokens: int  # the prompt tokens the routed worker computes (the rest it has cached)


@dataclass(frozen=True, slots=True)
class Bound:
    state: SessionState
    moved: bool  # newly (re)bound: its KV has to reach the worker (rounds.binding.Arrivals)


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What a round's engines did, measured by the caller's clock (wall or virtual)."""

    route: Literal["local", "remote"]  # as run: a remote prefill that failed ran locally
    decode_worker: str  # as run: a stream that migrated ended on another worker
    ttft_s: float | None  # None: no token came (a hidden tool call's round that broke)
    gaps: Gaps  # its inter-token gaps
    prompt_tokens: int
    completion_tokens: int
    queue_wait_s: float = 0.0
    prefill_s: float | None = None  # from the round's start until its prefill was over
    migrations: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """One sample for the windowed statistics: (series, worker, sum, count)."""

    series: str
    worker_id: str
    total: float
    count: int


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A finished round, as ``GET /v1/sessions/{id}`` lists it and reports aggregate it."""

    session_id: str
    round: int  # 1-based, within the session
    kind: Literal["initial", "incremental"]
    route: Literal["local", "remote"]
    reason: str
    queued_on: str  # the worker whose prefill queue it waited in (the route as planned)
    prefill_worker: str | None  # remote rounds
    decode_worker: str
    l_hist: int
    l_incr: int
    queue_wait_s: float
    ttft_s: float | None
    prefill_s: float | None
    mean_itl_s: float | None
    p95_itl_s: float | None
    max_itl_s: float | None
    slo_met: dict[ItlRule, bool]  # under each ITL rule (perfmodel.slo), with its TTFT
    completion_tokens: int
    started_at: float
    migrations: int
    split_at: int | None = None  # a split round's point: the prefill worker computed the prompt's first tokens

    @property
    def incremental(self) -> bool:
        return self.kind == "incremental"


@dataclass(frozen=True, slots=True)
class Closed:
    state: SessionState
    observations: tuple[Observation, ...]
    record: RoundRecord


def held_tokens(task: PrefillTask, route: Route) -> int:
    """The prompt tokens a remote route's prefill worker computes (less its cache) and holds:
    the whole prompt, or a split's first part (rounds.split_point)."""
    return task.l_total if route.split_at is None else route.split_at


def _prefill_load(view: WorkerView, signals: Signals) -> EngineLoad:
    """A prefill worker as placement sees it. Its KV holds the prompts it prefills until
    their decode workers pull them, so their tokens stand for its KV in use."""
    capacity = view.profile.kv_capacity_tokens
    return EngineLoad(
        view.worker_id, view.cached_tokens, view.active_tokens, signals.waiting.get(view.worker_id, 0),
        signals.running.get(view.worker_id, 0), min(1.0, view.active_tokens / max(capacity, 1)), capacity,
    )  # fmt: skip


class RoundCore:
    """One policy's decisions over rounds; holds only its configuration and its random stream."""

    def __init__(
        self,
        policy: Policy,
        alpha: float = ALPHA,
        beta: float = BETA,
        window: int = 3,
        rng: random.Random | None = None,
        itl_rule: ItlRule = "mean",
        placement: Placement = "memory",
    ) -> None:
        self.policy, self.alpha, self.beta, self.window = policy, alpha, beta, window
        self.rng, self.itl_rule, self.placement = rng or random.Random(), itl_rule, placement

    # -- a round begins ------------------------------------------------------------------
    def bind(
        self,
        state: SessionState | None,
        decoders: Sequence[DecodeCandidate],
        keeps_history: bool = True,
        holders: Collection[str] = (),
        prompt: Prompt | None = None,
    ) -> Bound:
        """The session on a decode worker that serves: its own while it is among
        ``decoders`` (the workers taking new rounds), else the one the placement rule
        picks for ``prompt`` (without it, or under ``memory``, the least loaded by memory).
        A session that moves starts over there with what that worker caches of its prompt
        as its history (nothing under ``memory``), and one whose request does not continue
        what its worker holds (``keeps_history`` false: the client rewrote its history)
        has nothing cached either: l_hist 0. If its old worker is among ``holders`` -
        alive, but no longer decoding (it changed role: rounds.roles) - its prefix cache
        still holds the session, which a remote prefill there reuses (Eq. 2 sees it as
        that worker's cached tokens) and the new worker pulls over NIXL."""
        if state is not None and any(c.worker_id == state.decode_worker for c in decoders):
            return Bound(state if keeps_history else replace(state, l_hist=0), moved=False)
        worker_id, cached = self._place_session(decoders, prompt)
        if state is None:
            return Bound(SessionState(worker_id, l_hist=cached), moved=True)
        if state.decode_worker in holders and keeps_history:
            moved = replace(state, decode_worker=worker_id, l_hist=cached, prefill_worker=state.decode_worker,
                            prefill_cached=state.l_hist)  # fmt: skip
            return Bound(moved, moved=True)
        return Bound(replace(state, decode_worker=worker_id, l_hist=cached), moved=True)

    def _place_session(self, decoders: Sequence[DecodeCandidate], prompt: Prompt | None) -> tuple[str, int]:
        """The decode worker a session (re)binds to, and the tokens of its prompt it caches."""
        if prompt is None or self.placement == "memory":
            return choose_decode_worker(decoders), 0
        engines = [self._decode_load(d, prompt) for d in decoders]
        block_size = prompt.workers[decoders[0].worker_id].block_size
        disaggregated = self.policy.uses_prefill_workers and not self.policy.unified
        worker_id = place(
            self.placement, PlacementContext("decode", prompt.l_total, block_size, engines, disaggregated)
        )
        return worker_id, next(e.cached_tokens for e in engines if e.worker_id == worker_id)

    @staticmethod
    def _decode_load(decoder: DecodeCandidate, prompt: Prompt) -> EngineLoad:
        """A decode worker as placement sees it: Eq. 1 of the prompt on it, with l_hist what
        its cache holds of the prompt."""
        signals, worker = prompt.signals, prompt.workers[decoder.worker_id]
        cached = min(max(0, signals.cached_tokens.get(decoder.worker_id, 0)), prompt.l_total - 1)
        view = signals.view(worker)
        return EngineLoad(
            decoder.worker_id, cached, view.active_tokens, signals.waiting.get(decoder.worker_id, 0),
            signals.running.get(decoder.worker_id, 0), decoder.expected_usage, decoder.kv_capacity_tokens,
            view.t_pre(cached, prompt.l_total - cached) + view.queue_cost,
        )  # fmt: skip

    def plan(
        self,
        state: SessionState,
        task_id: str,
        l_total: int,
        created_at: float,
        decode: Candidate,
        prefills: Sequence[Candidate],
        signals: Signals,
        slo: SLO,
    ) -> RoundPlan:
        """The round's prefill task, where it runs, and what it adds to that worker's queue.
        ``decode`` is the session's worker; ``prefills`` the prefill workers of its model."""
        l_hist = state.l_hist
        if self.placement != "memory":  # the index's word on what d holds, where it has one
            l_hist = signals.cached_tokens.get(decode.worker_id, l_hist)
        task = PrefillTask(task_id, min(l_hist, l_total - 1), l_total, created_at)
        decode_view = signals.view(decode, windowed_itl=signals.means.get((ITL, decode.worker_id)))
        prefill_views = []
        if self.policy.uses_prefill_workers and not decode.colocates:
            prefill_views = [
                signals.view(
                    p,
                    windowed_ttft=signals.means.get((TTFT_REMOTE, p.worker_id)),
                    cached_tokens=self._prefill_cached(state, p, signals),
                )  # fmt: skip
                for p in prefills
                if p.worker_id != decode.worker_id
            ]
            prefill_views = self._placed_prefills(prefill_views, l_total, decode.block_size, signals)
        ctx = RouteContext(
            task, decode_view, prefill_views, slo, self.alpha, self.beta, self.rng, decode.block_size, self.itl_rule
        )
        chosen = route(self.policy, ctx)
        if chosen.kind == "local":
            return RoundPlan(task, chosen, local_compute(task, decode_view), task.l_incr)
        prefill = next(v for v in prefill_views if v.worker_id == chosen.worker_id)
        end = held_tokens(task, chosen)
        cached = min(prefill.cached_tokens, end - 1)
        return RoundPlan(task, chosen, remote_compute(task, prefill, end), end - cached)

    def _prefill_cached(self, state: SessionState, prefill: Candidate, signals: Signals) -> int:
        """The round's prompt tokens ``prefill``'s cache holds: the index's word where placement
        reads it and it has one, else the session's own (its last remote round's prompt)."""
        if self.placement != "memory" and prefill.worker_id in signals.cached_tokens:
            return signals.cached_tokens[prefill.worker_id]
        return state.prefill_cached if prefill.worker_id == state.prefill_worker else 0

    def _placed_prefills(
        self, views: list[WorkerView], l_total: int, block_size: int, signals: Signals
    ) -> list[WorkerView]:
        """The prefill workers the policy may route to: every one under ``memory`` and
        ``ampd`` (Alg. 1 takes the cheapest by Eq. 2, each with its cached tokens), the
        one a production rule places the prompt on under the others."""
        if self.placement in ("memory", "ampd") or len(views) < 2:
            return views
        engines = [_prefill_load(v, signals) for v in views]
        chosen = place(self.placement, PlacementContext("prefill", l_total, block_size, engines))
        return [v for v in views if v.worker_id == chosen]

    # -- a worker's prefill queue dispatches ------------------------------------------------
    @property
    def window_size(self) -> int:
        """How many head tasks of a queue a dispatch looks at."""
        return self.policy.window(self.window)

    def pick(self, window: Sequence[QueuedTask], now: float) -> Decision:
        """Which of the queue's head ``window`` runs next (Alg. 2 for AMPD), as an order."""
        return pick(self.policy, window, now, self.window)

    # -- a round ends ------------------------------------------------------------------------
    def close(self, session_id: str, state: SessionState, plan: RoundPlan, result: RoundResult, slo: SLO) -> Closed:
        """What the round changes: the worker now holds its prompt and output; a remote
        round leaves its prompt in its prefill worker's cache; its TTFT and gaps go to
        the windowed statistics of the workers that served it; its record says whether it
        met ``slo`` under each ITL rule."""
        task, remote = plan.task, result.route == "remote"
        after = SessionState(
            decode_worker=result.decode_worker,
            l_hist=result.prompt_tokens + result.completion_tokens,
            prefill_worker=plan.route.worker_id if remote else state.prefill_worker,
            prefill_cached=held_tokens(task, plan.route) if remote else state.prefill_cached,
            rounds=state.rounds + 1,
        )
        ttft_at = (TTFT_REMOTE, plan.route.worker_id) if remote else (TTFT_LOCAL, result.decode_worker)
        observations = (
            Observation(*ttft_at, result.ttft_s or 0.0, 0 if result.ttft_s is None else 1),
            Observation(ITL, result.decode_worker, result.gaps.total_s, result.gaps.count),
        )
        record = RoundRecord(
            session_id=session_id,
            round=after.rounds,
            kind="incremental" if task.incremental else "initial",
            route=result.route,
            reason=plan.route.reason,
            queued_on=plan.route.worker_id,
            prefill_worker=plan.route.worker_id if remote else None,
            decode_worker=result.decode_worker,
            l_hist=task.l_hist,
            l_incr=task.l_incr,
            queue_wait_s=result.queue_wait_s,
            ttft_s=result.ttft_s,
            prefill_s=result.prefill_s,
            mean_itl_s=result.gaps.mean_s,
            p95_itl_s=result.gaps.p95_s,
            max_itl_s=result.gaps.max_s,
            slo_met={rule: slo.met(result.ttft_s, result.gaps.by(rule)) for rule in ITL_RULES},
            completion_tokens=result.completion_tokens,
            started_at=task.created_at,
            migrations=result.migrations,
            split_at=plan.route.split_at if remote else None,
        )
        return Closed(after, tuple(o for o in observations if o.count > 0), record)
