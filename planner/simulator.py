"""Discrete-event simulation of the whole system in virtual time (AMPD Appendix A.1).

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"), Appendix A.1: the planner's simulator runs a
deployment - prefill and decode pools of given TP and DP - over a trace, with phase
splitting, KV transfer on the alpha-beta model and the runtime routing decision. Here
it is the live system's own code with the clock and the network taken out:

* every worker is a ``rounds.engine.scheduler.Scheduler`` (the GPU-free engine's core:
  continuous batching, chunked prefill, paged KV with prefix caching, preemption,
  NixlConnector-style holds and pulls), stepped in virtual time with fused decode steps;
* every round goes through the gateway's pure core: ``rounds.binding`` for new
  sessions, ``rounds.policies.route`` (Alg. 1) fed with windowed TTFT/ITL means and
  queued prefill seconds, and ``rounds.policies.pick`` (Alg. 2) at every dispatch
  from a worker's prefill queue with its slots - the decisions gateway.queues commits
  to Redis, here kept in memory;
* the hand-off is vLLM's: the prefill worker computes the whole prompt (less its own
  prefix-cache hits) and holds the blocks, the decode worker pulls the blocks it lacks
  (T_kv), recomputes the last prompt token and decodes; local rounds prefill the
  increment on the decode worker.

Differences from the live system, all deliberate: no network or gateway CPU time, KV
usage for binding is scraped every second as the gateway's pool does but without its
HTTP delay, and token ids are synthetic (unique per session, so prefix caching hits
exactly what the session's history is; the engine's block keys name the session and the
block's place instead of hashing its tokens, which hits and evicts alike:
``SimSession.block_hashes``).

Speed: the simulator is the planner's inner loop (``ampd bench simulate``). Work that
arrives at an engine in the middle of a fused decode step is looked at once, at the
sub-step boundary where a real engine would next schedule; a request that only waits
there for its prompt's KV joins without ending the step (``Scheduler.admit_during``).
``tests/test_sim_equality.py`` holds the results still (to 1e-9) while this code changes.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from pydantic import BaseModel, Field

from perfmodel.profile import Profile, t_kv
from perfmodel.slo import ITL_RULES, SLO, Gaps, ItlRule
from planner.trace import TraceSession
from rounds.binding import Arrivals, DecodeCandidate
from rounds.core import (
    ITL,
    TTFT_REMOTE,
    Candidate,
    RoundCore,
    RoundPlan,
    RoundRecord,
    RoundResult,
    SessionState,
    Signals,
    held_tokens,
)
from rounds.elastic import Demand, ElasticController, EngineState, Move, RolePlan
from rounds.engine.request import RemotePrefill, Request
from rounds.engine.scheduler import KVLoad, Scheduler, SchedulerConfig, Step
from rounds.policies import POLICIES, step_target
from rounds.reordering import QueuedTask
from rounds.roles import Assignment, Role, busy, counts, settle
from rounds.roles import move as move_to
from rounds.windowed import WindowedMeans

SCRAPE_INTERVAL_S = 1.0  # the gateway's pool refresh (GatewayConfig.scrape_interval_s)
_FILLER = list(range(256)) * 512  # token ids to slice from (see Simulation._fresh_tokens)


@dataclass(frozen=True)
class Pool:
    """``replicas`` workers of one profile (its TP degree is the profile's)."""

    profile: Profile
    replicas: int

    @property
    def gpus(self) -> int:
        return self.profile.tp * self.replicas

    def label(self) -> str:
        return f"TP={self.profile.tp}, DP={self.replicas} on {self.profile.gpu.name}"


@dataclass(frozen=True)
class SimConfig:
    decode: Pool
    prefill: Pool | None
    slo: SLO
    policy: str = "ampd"
    alpha: float = 0.9
    beta: float = 0.85
    window: int = 3
    stats_window_s: int = 10
    prefill_slots: int = 1
    seed: int = 0
    itl_rule: ItlRule = "mean"  # how rounds are judged (perfmodel.slo)
    scheduler: SchedulerConfig = SchedulerConfig()
    decode_prefill_chunk: int = 0  # decode workers' long_prefill_token_threshold (0: no cap)
    initial_prefill: int = 0  # an elastic pool (``decode``, no ``prefill``): engines that start as prefill
    role_plan: RolePlan | None = None  # an elastic pool's planned split by load (rounds.elastic)
    max_decode_steps: int = 64  # fused decode steps per event; results do not depend on it


# -- the pieces of the live system that hold state, kept in memory -----------------------
@dataclass
class PrefillQueue:
    """One worker's prefill queue and slots (gateway.state.prefill_queue without Redis)."""

    tasks: list[QueuedTask] = field(default_factory=list)
    inflight: int = 0
    cost: float = 0.0  # Eq. 1-2's queue term: estimated seconds queued
    tokens: int = 0  # prompt tokens the queued and the running prefills compute here


@dataclass
class SimWorker:
    worker_id: str
    assignment: Assignment  # its role (rounds.roles)
    profile: Profile
    scheduler: Scheduler
    candidate: Candidate  # the worker as the round core sees it
    queue: PrefillQueue = field(default_factory=PrefillQueue)
    step: Step | None = None
    step_start: float = 0.0
    version: int = 0  # invalidates step-end events of steps cut short
    looking: tuple[int, float] = (0, 0.0)  # (version, offset) of the step boundary a look is due at (Simulation._kick)
    busy_s: float = 0.0
    kv_snapshot: float = 0.0  # KV usage at the last scrape
    decoding: int = 0  # rounds of sessions bound here, in flight
    remote_prefills: int = 0  # other engines' prefills queued or running here

    def busy_with(self) -> set[Role]:
        """The roles whose work it still has (rounds.roles: what a move leaves draining)."""
        return busy(self.remote_prefills > 0, self.decoding > 0)


@dataclass
class SimSession:
    trace: TraceSession
    index: int  # the session's number: its token ids are unique to it
    next_round: int = 0
    state: SessionState | None = None  # the round core's view of it (rounds.core)
    tokens: list[int] = field(default_factory=list)  # the conversation so far, as the engine sees it
    next_token: int = 0

    def block_hashes(self, num_tokens: int, block_size: int) -> list[int]:
        """The prefix cache's keys for the full blocks of its first ``num_tokens`` tokens.

        A block's key in the engine is a hash chained over every token before it; a
        session's tokens are unique to it and never change once said, so that hash
        stands for (session, block position) and no two differ in anything else. Naming
        the pair directly gives the engine the same keys up to their values, so it hits
        and evicts exactly as it would, without hashing every block of every round."""
        first = (self.index + 1) << 32
        return list(range(first, first + num_tokens // block_size))


@dataclass
class RoundState:
    session: SimSession
    plan: RoundPlan
    output_plan: list[int]
    arriving: int = 0  # prompt tokens expected at its decode worker, newly bound (rounds.binding.Arrivals)
    dispatched_at: float = 0.0
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    gaps_s: float = 0.0  # their sum, as spans of token times (the mean ITL exactly as before)
    gaps: list[float] = field(default_factory=list)  # every inter-token gap, for the tail rules


@dataclass
class _Interval:
    """The rounds of one forecast interval, counted as live (gateway.elastic_live.DemandLog)."""

    rounds: int = 0
    prefill: int = 0
    context: int = 0
    finished: int = 0
    output: int = 0

    def arrived(self, prefill: int, context: int) -> None:
        self.rounds += 1
        self.prefill += prefill
        self.context += context

    def done(self, output: int) -> None:
        self.finished += 1
        self.output += output

    def demand(self, seconds: float) -> Demand:
        return Demand.of(seconds, self.rounds, self.prefill, self.context, self.finished, self.output)


# -- the report ---------------------------------------------------------------------------
class RolesAt(BaseModel):
    """How many engines had each role from ``at`` on (elastic pools)."""

    at: float
    prefill: int
    decode: int
    mixed: int
    unified: int = 0


class LatencySummary(BaseModel):
    count: int
    mean_s: float | None
    p95_s: float | None


class WorkerUsage(BaseModel):
    worker_id: str
    role: str
    utilisation: float  # fraction of the run the worker was stepping
    preemptions: int


class SimReport(BaseModel):
    policy: str
    prefill: str
    decode: str
    gpus: int
    sessions: int
    rounds: int
    ttft_slo_s: float
    itl_slo_s: float
    ttft: LatencySummary
    ttft_initial: LatencySummary
    ttft_incremental: LatencySummary
    itl: LatencySummary  # of each round's mean inter-token gap
    itl_p95: LatencySummary  # of each round's 95th-percentile gap
    itl_max: LatencySummary  # of each round's longest gap
    prefill_phase: LatencySummary
    first_token_after_prefill: LatencySummary  # TTFT less the prefill phase: KV pull, admission, first step
    itl_rule: ItlRule = "mean"  # how a round's gaps are judged (perfmodel.slo)
    slo_attainment_rounds: float  # rounds meeting the TTFT threshold and, by the ITL rule, the ITL one
    slo_attainment_by_rule: dict[ItlRule, float]  # the same under every ITL rule
    slo_attainment_sessions: float  # sessions all of whose rounds did (by the ITL rule)
    local_share_incremental: float  # incremental prefills run on the decode worker
    local_share: float
    split_share: float = 0.0  # rounds whose prompt was split between two engines (rounds.split_point)
    makespan_s: float
    workers: list[WorkerUsage]
    wall_s: float = 0.0
    moves: int = 0  # role changes (elastic pools)
    roles: list[RolesAt] = []  # the pool's roles over time (elastic pools)
    # (TTFT, mean, P95, longest gap, its session's arrival) of every round, to judge the run by
    # another SLO; not dumped.
    round_latencies: list[tuple[float, float | None, float | None, float | None, float]] = Field(
        default=[], exclude=True
    )

    def round_itl(self, rule: ItlRule) -> LatencySummary:
        return {"mean": self.itl, "p95": self.itl_p95, "max": self.itl_max}[rule]

    def attainment(self, slo: SLO, rule: ItlRule) -> float:
        """The share of rounds meeting ``slo`` by ``rule``: the same run judged by another SLO.
        (A policy whose decisions read the SLO - ampd's - would have decided differently.)"""
        met = self.verdicts(slo, rule)
        return sum(met) / len(met) if met else 0.0

    def verdicts(self, slo: SLO, rule: ItlRule) -> list[bool]:
        """Whether each round met ``slo`` by ``rule``, in the order the rounds finished."""
        column = {"mean": 1, "p95": 2, "max": 3}[rule]
        return [slo.met(r[0], r[column]) for r in self.round_latencies]

    def by_minute(self, slo: SLO, rule: ItlRule) -> dict[int, tuple[int, int]]:
        """(rounds met, rounds) by the minute each round's session arrived in: the same rounds
        in every deployment that ran the trace, so their verdicts compare minute by minute."""
        out: dict[int, tuple[int, int]] = {}
        for r, met in zip(self.round_latencies, self.verdicts(slo, rule), strict=True):
            minute = int(r[4] // 60)
            done, n = out.get(minute, (0, 0))
            out[minute] = (done + met, n + 1)
        return out

    @property
    def tau_prefill(self) -> float | None:
        """P95 prefill-phase latency over TTFT_thres: the planner's tau_pre (Eq. 5)."""
        p95 = self.prefill_phase.p95_s
        return None if p95 is None else p95 / self.ttft_slo_s

    @property
    def tau_decode(self) -> float | None:
        """The planner's tau_dec (Eq. 5): the worse of P95 per-round ITL (by the ITL rule) over ITL_thres and
        P95 time from prefill to first token over TTFT_thres - a decode replica whose KV
        cache is full holds first tokens back while its ITL looks fine."""
        itl, first = self.round_itl(self.itl_rule).p95_s, self.first_token_after_prefill.p95_s
        if itl is None:
            return None
        return max(itl / self.itl_slo_s, (first or 0.0) / self.ttft_slo_s)


def _summary(values: Sequence[float]) -> LatencySummary:
    if not values:
        return LatencySummary(count=0, mean_s=None, p95_s=None)
    array = np.asarray(values)
    return LatencySummary(count=len(values), mean_s=float(array.mean()), p95_s=float(np.percentile(array, 95)))


# -- the simulation -----------------------------------------------------------------------
class Simulation:
    """One run of ``sessions`` through a deployment. ``run()`` once, then read ``report()``."""

    def __init__(self, config: SimConfig, sessions: Sequence[TraceSession]) -> None:
        self.config = config
        policy = POLICIES[config.policy]
        rng = random.Random(config.seed)
        self.core = RoundCore(policy, config.alpha, config.beta, config.window, rng, config.itl_rule)
        self.stats = WindowedMeans(config.stats_window_s)
        self.controller = None if policy.elastic is None else ElasticController(
            policy.elastic, config.slo, config.alpha, config.beta, config.role_plan
        )  # fmt: skip
        if self.controller is not None:  # one pool; roles change with the load
            engines = [self._worker(f"engine-{i}", "decode", config.decode.profile)
                       for i in range(config.decode.replicas)]  # fmt: skip
            for w in engines[: config.initial_prefill]:
                w.assignment = Assignment(w.worker_id, "prefill")
        elif policy.unified and config.prefill is None:  # one pool: every engine runs any part of any round
            engines = [self._worker(f"engine-{i}", "unified", config.decode.profile)
                       for i in range(config.decode.replicas)]  # fmt: skip
        else:
            engines = [self._worker(f"decode-{i}", "decode", config.decode.profile)
                       for i in range(config.decode.replicas)]  # fmt: skip
            if config.prefill is not None and policy.uses_prefill_workers:
                engines += [self._worker(f"prefill-{i}", "prefill", config.prefill.profile)
                            for i in range(config.prefill.replicas)]  # fmt: skip
        self.workers = {w.worker_id: w for w in engines}
        self._group()
        self.timeline: list[RolesAt] = []
        self.moves: list[tuple[float, Move]] = []
        self.interval = _Interval()
        self.sessions = [SimSession(s, i) for i, s in enumerate(sessions)]
        self.records: list[RoundRecord] = []
        self.rounds: dict[str, RoundState] = {}  # by engine request id
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self.now = 0.0
        self._next_scrape = 0.0
        self.arrivals = Arrivals()  # bound sessions' prompts no scrape shows yet (rounds.binding)

    def _worker(self, worker_id: str, role: Role, profile: Profile) -> SimWorker:
        c = self.config
        chunk = c.decode_prefill_chunk if role == "decode" else 0
        target = step_target(POLICIES[c.policy], c.slo, c.itl_rule, c.beta)
        scheduler = Scheduler(profile, replace(c.scheduler, long_prefill_token_threshold=chunk, step_target_s=target))
        candidate = Candidate(worker_id, profile, block_size=scheduler.kv.block_size, prefill_chunk=chunk)
        return SimWorker(worker_id, Assignment(worker_id, role), profile, scheduler, candidate)

    def _group(self) -> None:
        """The engines sessions are bound to (decode and mixed roles) and those others'
        sessions prefill on, as the roles stand: kept, not recomputed at every round."""
        self.decoders = [w for w in self.workers.values() if w.assignment.binds]
        self.prefillers = [w for w in self.workers.values() if w.assignment.prefills_remote]

    def _at(self, when: float, action: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action, args))

    def run(self) -> None:
        # Sessions arrive from a sorted list rather than the heap, which then holds only
        # what is in flight. An arrival goes before any other event at its time, as it would
        # from the heap (its sequence number would be smaller); the sort is stable, so
        # arrivals at one time keep their order.
        arrivals = sorted(self.sessions, key=lambda s: s.trace.arrival_s)
        self._unfinished = len(self.sessions)
        if self.controller is not None:
            self._record_roles()
            self._at(self.controller.config.interval_s, self._control)
            self._at(self.controller.config.forecast_interval_s, self._forecast)
        events, pop, start_round = self._events, heapq.heappop, self._start_round
        for session in arrivals:
            arrival = session.trace.arrival_s
            while events and events[0][0] < arrival:
                self.now, _, action, args = pop(events)
                action(*args)
            self.now = arrival
            start_round(session)
        while events:
            self.now, _, action, args = pop(events)
            action(*args)

    # -- gateway: a round becomes a routed, queued prefill task ------------------------
    def _start_round(self, session: SimSession) -> None:
        now = self.now
        self._scrape(now)
        spec = session.trace.rounds[session.next_round]
        session.tokens.extend(self._fresh_tokens(session, spec.input_tokens))
        l_total = len(session.tokens)
        bound = self.core.bind(session.state, [
            DecodeCandidate(w.worker_id, w.kv_snapshot, w.profile.kv_capacity_tokens, self.arrivals.tokens[w.worker_id])
            for w in self.decoders
        ], holders=self.workers)  # fmt: skip
        if bound.moved:
            self.arrivals.expect(bound.state.decode_worker, l_total)
        session.state = state = bound.state
        decode = self.workers[state.decode_worker]
        prefills, signals = [p.candidate for p in self.prefillers], self._signals(decode)
        candidate = replace(decode.candidate, colocates=True) if decode.assignment.colocates else decode.candidate
        plan = self.core.plan(state, f"t{next(self._ids)}", l_total, now, candidate, prefills, signals, self.config.slo)
        self.interval.arrived(plan.tokens, l_total)  # what the elastic controller forecasts from, as live
        decode.decoding += 1
        task = plan.task
        output_plan = self._fresh_tokens(session, spec.output_tokens)
        round_state = RoundState(session, plan, output_plan, arriving=l_total if bound.moved else 0)
        worker = self.workers[plan.route.worker_id]
        if plan.route.kind == "remote":
            worker.remote_prefills += 1
        queued = QueuedTask(task.task_id, now, plan.estimate_s, self.config.slo.ttft_s, 0, task.incremental)
        worker.queue.tasks.append(queued)
        worker.queue.cost += plan.estimate_s
        worker.queue.tokens += plan.tokens
        self.rounds[task.task_id] = round_state
        self._dispatch(worker)

    def _signals(self, decode: SimWorker) -> Signals:
        """What the gateway reads from Redis at a round's start, from memory."""
        now, mean = self.now, self.stats.mean
        workers = (decode, *self.prefillers)
        costs = {w.worker_id: w.queue.cost for w in workers}
        tokens = {w.worker_id: w.queue.tokens for w in workers}
        means = {(ITL, decode.worker_id): mean(ITL, decode.worker_id, now)}
        means.update(((TTFT_REMOTE, p.worker_id), mean(TTFT_REMOTE, p.worker_id, now)) for p in self.prefillers)
        return Signals(costs, {k: v for k, v in means.items() if v is not None}, tokens)

    def _fresh_tokens(self, session: SimSession, n: int) -> list[int]:
        """Token ids for ``n`` new tokens of ``session``. Only the session's very first token
        is unique to it: block hashes chain over their parent, so every later block of the
        session differs from every other session's anyway, and the rest can be small ints
        (CPython's shared objects - a long trace would otherwise allocate one per token)."""
        offset = session.next_token
        session.next_token += n
        tokens = (
            _FILLER[offset % 256 : offset % 256 + n]
            if n <= len(_FILLER) - 256
            else [(offset + i) % 256 for i in range(n)]
        )
        if offset == 0:
            tokens[0] = 256 + session.index
        return tokens

    def _scrape(self, now: float) -> None:
        """The gateway's pool refresh: KV usage as of the last second, pending bindings reset."""
        if now < self._next_scrape:
            return
        for w in self.decoders:  # the usage a real engine has mid-step
            w.kv_snapshot = w.scheduler.kv_usage(w.step, self.now - w.step_start)
        self.arrivals.scraped(self.arrivals.scrape_started())  # a scrape here takes no time
        self._next_scrape = math.floor(now / SCRAPE_INTERVAL_S + 1) * SCRAPE_INTERVAL_S

    def _dispatch(self, worker: SimWorker) -> None:
        """Start queued tasks while slots are free, in the order the policy picks (Alg. 2)."""
        queue = worker.queue
        while queue.tasks and queue.inflight < self.config.prefill_slots:
            size = self.core.window_size
            window = queue.tasks[:size]
            decision = self.core.pick(window, self.now)
            bumped = set(decision.postponed)
            rest = [replace(window[i], postponed=window[i].postponed + 1) if i in bumped else window[i]
                    for i in decision.order[1:]]  # fmt: skip
            chosen = window[decision.order[0]]
            queue.tasks[:size] = rest
            queue.inflight += 1
            queue.cost -= chosen.estimate_s
            state = self.rounds[chosen.task_id]
            state.dispatched_at = self.now
            self._launch(state)

    def _release(self, worker: SimWorker, state: RoundState) -> None:
        worker.queue.inflight -= 1
        worker.queue.tokens -= state.plan.tokens
        self._dispatch(worker)

    def _launch(self, state: RoundState) -> None:
        """Send the round to its engine: vLLM's hand-off for remote, one request for local."""
        session, task, route = state.session, state.plan.task, state.plan.route
        prompt = session.tokens[: task.l_total]
        request_id = task.task_id
        if route.kind == "remote":  # the prompt, or a split's first part (rounds.split_point)
            prefill = self.workers[route.worker_id]
            alpha = prompt[: held_tokens(task, route)]
            request = Request(request_id, alpha, state.output_plan[:1], 1, self.now, do_remote_decode=True)
            request.block_hashes = self._block_hashes(state)
            self._submit(prefill, request, state)
            return
        request = Request(request_id, prompt, state.output_plan, len(state.output_plan), self.now)
        request.block_hashes = self._block_hashes(state)
        self._submit(self.decode_worker(session), request, state)

    def _block_hashes(self, state: RoundState) -> list[int]:
        """Keys for every block the round's requests may fill: its prompt and its output."""
        tokens = state.plan.task.l_total + len(state.output_plan)
        return state.session.block_hashes(tokens, self.config.scheduler.block_size)

    def decode_worker(self, session: SimSession) -> SimWorker:
        assert session.state is not None
        return self.workers[session.state.decode_worker]

    def _submit(self, worker: SimWorker, request: Request, state: RoundState) -> None:
        self.rounds[request.request_id] = state
        worker.scheduler.add_request(request)
        self._kick(worker)

    # -- engines: stepping in virtual time ---------------------------------------------
    def _kick(self, worker: SimWorker) -> None:
        """New work for ``worker``: start a step, or look again at a fused one's next boundary,
        where a real engine would next schedule (:meth:`_boundary`)."""
        step = worker.step
        if step is None:
            self._start_step(worker)
        elif step.num_steps > 1:
            elapsed = step.boundaries[bisect_left(step.boundaries, self.now - worker.step_start)]
            if (worker.version, elapsed) != worker.looking:  # one look per boundary, however much work came
                worker.looking = (worker.version, elapsed)
                self._at(worker.step_start + elapsed, self._boundary, worker, worker.version, elapsed)

    def _boundary(self, worker: SimWorker, version: int, elapsed: float) -> None:
        """A fused step's boundary (``elapsed`` after its start) with new work: admit what only
        waits for its KV and go on, or end the step here where the batch changes
        (Scheduler.admit_during)."""
        step = worker.step
        if version != worker.version or step is None:
            return
        worker.looking = (-1, 0.0)  # work that comes later, even now, gets a look of its own
        loads, goes_on = worker.scheduler.admit_during(step, elapsed, self.now)
        self._pull(worker, loads)
        if not goes_on:
            worker.scheduler.cut(step, elapsed)
            worker.version += 1
            self._end_step(worker, worker.version)

    def _start_step(self, worker: SimWorker) -> None:
        step = worker.scheduler.schedule(self.now, self.config.max_decode_steps)
        self._pull(worker, step.kv_loads)
        if step.empty:
            worker.step = None
            return
        worker.step, worker.step_start = step, self.now
        worker.version += 1
        self._at(self.now + step.duration, self._end_step, worker, worker.version)

    def _pull(self, worker: SimWorker, loads: list[KVLoad]) -> None:
        """Pull each request's prompt KV from the engine that computed it (T_kv)."""
        for load in loads:
            remote = load.request.remote_prefill
            assert remote is not None
            source = self.workers[remote.engine_id]
            done = self.now + t_kv(load.num_tokens, source.profile, worker.profile)
            self._at(done, self._kv_loaded, worker, load.request.request_id, source, remote.request_id)

    def _end_step(self, worker: SimWorker, version: int) -> None:
        if version != worker.version or worker.step is None:
            return  # a step cut short: its new end is another event
        step, start = worker.step, worker.step_start
        worker.step = None
        worker.busy_s += step.duration
        ends = [start + b for b in step.boundaries] if step.boundaries else [self.now]
        for out in worker.scheduler.finish_step(step, self.now):
            state = self.rounds.get(out.request.request_id)
            if state is None:
                continue
            if out.request.do_remote_decode:
                self._prefilled(worker, state, out.request, out.held_block_ids)
            else:
                self._tokens(worker, state, ends[-len(out.new_token_ids) :], out.finished, out.request)
        self._start_step(worker)

    def _kv_loaded(self, worker: SimWorker, request_id: str, source: SimWorker, source_request_id: str) -> None:
        worker.scheduler.finish_kv_load(request_id, ok=True)
        source.scheduler.release_transfer(source_request_id)
        self._kick(worker)
        if source.scheduler.has_work:  # the freed blocks may let a waiting request in
            self._kick(source)

    # -- gateway: what comes back -------------------------------------------------------
    def _prefilled(self, prefill: SimWorker, state: RoundState, request: Request, held: tuple[int, ...]) -> None:
        """The remote prefill answered: free its slot, send the decode with the transfer params."""
        state.prefill_done_at = self.now
        self.rounds.pop(request.request_id, None)
        prefill.remote_prefills -= 1
        self._release(prefill, state)
        session = state.session
        remote = RemotePrefill(prefill.worker_id, "", 0, request.request_id, held, request.num_prompt_tokens)
        decode = Request(f"{request.request_id}-d", session.tokens[: state.plan.task.l_total], state.output_plan,
                         len(state.output_plan), self.now, remote_prefill=remote)  # fmt: skip
        decode.block_hashes = self._block_hashes(state)
        self._submit(self.decode_worker(session), decode, state)

    def _tokens(
        self, decode: SimWorker, state: RoundState, times: list[float], finished: bool, request: Request
    ) -> None:
        if state.first_token_at is None:
            state.first_token_at = state.last_token_at = times[0]
            if state.arriving:  # its KV is on the decode worker: the next scrape shows it
                self.arrivals.landed(decode.worker_id, state.arriving)
                state.arriving = 0
            if state.plan.route.kind == "local":  # the local prefill is over: free the slot
                state.prefill_done_at = times[0]
                self._release(decode, state)
            times = times[1:]
        if times:
            state.gaps_s += times[-1] - state.last_token_at
            state.gaps.append(times[0] - state.last_token_at)
            state.gaps.extend(map(float.__sub__, times[1:], times[:-1]))
            state.last_token_at = times[-1]
        if finished:
            self._finish_round(state, request)

    def _finish_round(self, state: RoundState, request: Request) -> None:
        session, plan = state.session, state.plan
        assert session.state is not None and state.first_token_at is not None and state.prefill_done_at is not None
        self.rounds.pop(request.request_id, None)
        self.rounds.pop(plan.task.task_id, None)
        result = RoundResult(
            route=plan.route.kind,
            decode_worker=session.state.decode_worker,
            ttft_s=state.first_token_at - plan.task.created_at,
            gaps=Gaps.of(state.gaps, state.gaps_s),
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            queue_wait_s=state.dispatched_at - plan.task.created_at,
            prefill_s=state.prefill_done_at - plan.task.created_at,
        )
        closed = self.core.close(session.trace.session_id, session.state, plan, result, self.config.slo)
        self.workers[session.state.decode_worker].decoding -= 1
        self.interval.done(request.num_output_tokens)
        for o in closed.observations:
            self.stats.record(o, self.now)
        self.records.append(closed.record)
        session.state = closed.state
        session.tokens.extend(request.output_token_ids)
        spec = session.trace.rounds[session.next_round]
        session.next_round += 1
        if session.next_round < len(session.trace.rounds):
            self._at(self.now + spec.tool_latency_s, self._start_round, session)
        else:  # done: its conversation (tens of MB over a long trace) is not needed any more
            session.tokens = []
            self._unfinished -= 1

    # -- the elastic controller (rounds.elastic), on the same events as live --------------
    def _engines(self) -> list[EngineState]:
        now = self.now
        return [
            EngineState(w.assignment, w.profile, 1.0, max(0.0, w.queue.cost), w.decoding,
                        w.scheduler.kv_usage(w.step, now - w.step_start), self.stats.mean(ITL, w.worker_id, now))
            for w in self.workers.values()
        ]  # fmt: skip

    def _control(self) -> None:
        assert self.controller is not None
        for w in self.workers.values():
            w.assignment = settle(w.assignment, w.busy_with())
        for move in self.controller.tick(self.now, self._engines()):
            w = self.workers[move.worker_id]
            w.assignment = move_to(w.assignment, move.role, self.now, bool(w.busy_with() & {w.assignment.role}))
            self.moves.append((self.now, move))
            self._group()
            self._record_roles()
        if self._unfinished:
            self._at(self.now + self.controller.config.interval_s, self._control)

    def _forecast(self) -> None:
        assert self.controller is not None
        interval = self.controller.config.forecast_interval_s
        self.controller.observe(self.interval.demand(interval), self._engines())
        self.interval = _Interval()
        if self._unfinished:
            self._at(self.now + interval, self._forecast)

    def _record_roles(self) -> None:
        self.timeline.append(RolesAt(at=self.now, **counts(w.assignment for w in self.workers.values())))

    # -- results --------------------------------------------------------------------
    def report(self, wall_s: float = 0.0) -> SimReport:
        records, slo, rule = self.records, self.config.slo, self.config.itl_rule
        met = [r.slo_met[rule] for r in records]
        by_session: dict[str, bool] = {}
        for record, ok in zip(records, met, strict=True):
            by_session[record.session_id] = by_session.get(record.session_id, True) and ok
        complete = {s.trace.session_id for s in self.sessions if s.next_round == len(s.trace.rounds)}
        incremental = [r for r in records if r.incremental]
        arrival = {s.trace.session_id: s.trace.arrival_s for s in self.sessions}
        start = min((s.trace.arrival_s for s in self.sessions), default=0.0)
        makespan = max(self.now - start, 1e-9)
        pools = f"{self.config.prefill.label()}" if self.prefillers and self.config.prefill else "none"
        return SimReport(
            policy=self.config.policy,
            prefill=pools,
            decode=self.config.decode.label(),
            gpus=self.config.decode.gpus + (self.config.prefill.gpus if self.prefillers and self.config.prefill else 0),
            sessions=len(self.sessions),
            rounds=len(records),
            ttft_slo_s=slo.ttft_s,
            itl_slo_s=slo.itl_s,
            ttft=_summary([r.ttft_s for r in records]),
            ttft_initial=_summary([r.ttft_s for r in records if not r.incremental]),
            ttft_incremental=_summary([r.ttft_s for r in incremental]),
            itl=_summary([r.mean_itl_s for r in records if r.mean_itl_s is not None]),
            itl_p95=_summary([r.p95_itl_s for r in records if r.p95_itl_s is not None]),
            itl_max=_summary([r.max_itl_s for r in records if r.max_itl_s is not None]),
            prefill_phase=_summary([r.prefill_s for r in records]),
            first_token_after_prefill=_summary([r.ttft_s - r.prefill_s for r in records]),
            itl_rule=rule,
            slo_attainment_rounds=sum(met) / len(met) if met else 0.0,
            slo_attainment_by_rule={
                r: sum(record.slo_met[r] for record in records) / len(records) if records else 0.0 for r in ITL_RULES
            },
            slo_attainment_sessions=(
                sum(1 for s, ok in by_session.items() if ok and s in complete) / len(self.sessions)
                if self.sessions
                else 0.0
            ),
            local_share_incremental=(
                sum(r.route == "local" for r in incremental) / len(incremental) if incremental else 0.0
            ),
            local_share=sum(r.route == "local" for r in records) / len(records) if records else 0.0,
            split_share=sum(r.split_at is not None for r in records) / len(records) if records else 0.0,
            makespan_s=makespan,
            workers=[
                WorkerUsage(
                    worker_id=w.worker_id,
                    role=w.assignment.role,
                    utilisation=w.busy_s / makespan,
                    preemptions=w.scheduler.num_preemptions,
                )
                for w in self.workers.values()
            ],  # fmt: skip
            wall_s=wall_s,
            moves=len(self.moves),
            roles=self.timeline,
            round_latencies=[
                (r.ttft_s, r.mean_itl_s, r.p95_itl_s, r.max_itl_s, arrival[r.session_id]) for r in records
            ],
        )


def simulate(config: SimConfig, sessions: Sequence[TraceSession]) -> SimReport:
    """Run ``sessions`` through the deployment ``config`` and summarise (wall time included)."""
    started = time.perf_counter()
    sim = Simulation(config, sessions)
    # The run allocates millions of short-lived containers and frees them without cycles;
    # the cyclic collector would rescan every live session's token lists again and again.
    enabled = gc.isenabled()
    gc.disable()
    try:
        sim.run()
    finally:
        if enabled:
            gc.enable()
    return sim.report(wall_s=time.perf_counter() - started)
