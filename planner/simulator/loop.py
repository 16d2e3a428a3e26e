"""A simulation's run: the workers set up for the deployment, and the discrete-event loop.

Events are (virtual time, sequence number, action, arguments) on a heap; the sequence
number keeps events at one time in the order they were made, so that a run is the same
every time. The actions are the sides' (planner.simulator.gateway_side, engine_side,
elastic_control); ``Simulation`` is the three together on the state they share
(planner.simulator.state).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from perfmodel.profile import Profile
from planner.placement import Engine, place
from planner.simulator.config import SimConfig
from planner.simulator.elastic_control import ElasticControl
from planner.simulator.engine_side import EngineSide
from planner.simulator.gateway_side import GatewaySide
from planner.simulator.report import SimReport, summarise
from planner.simulator.state import ForecastInterval, SimSession, SimWorker, shared_prefix
from planner.trace import TraceSession
from rounds.binding import Arrivals
from rounds.core import Candidate, RoundCore
from rounds.elastic import ElasticController
from rounds.engine.scheduler import Scheduler
from rounds.policies import POLICIES, step_target
from rounds.roles import Assignment, Role
from rounds.windowed import WindowedMeans


class Simulation(GatewaySide, EngineSide, ElasticControl):
    """One run of ``sessions`` through a deployment. ``run()`` once, then read ``report()``."""

    def __init__(self, config: SimConfig, sessions: Sequence[TraceSession], keep_gaps: bool = False) -> None:
        """``keep_gaps``: keep every inter-token gap of every round in ``token_gaps`` (a
        distribution to compare with a live run's; off, a long trace's runs keep none)."""
        self.config = config
        policy = POLICIES[config.policy]
        rng = random.Random(config.seed)
        self.core = RoundCore(policy, config.alpha, config.beta, config.window, rng, config.itl_rule,
                              config.placement)  # fmt: skip
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
        servers = place([Engine(w.worker_id, w.profile.tp, w.assignment.role) for w in engines],
                        min(w.profile.gpu.gpus_per_node for w in engines))  # fmt: skip
        for w in engines:
            w.candidate = replace(w.candidate, node=servers[w.worker_id])
        self.workers = {w.worker_id: w for w in engines}
        self._group()
        self.timeline = []
        chains: dict[tuple[str, ...], int] = {}  # a shared prefix's segments so far -> its number
        self.moves = []
        self.interval = ForecastInterval()
        self.sessions = [SimSession(s, i, shared_prefix(s, chains)) for i, s in enumerate(sessions)]
        self.records = []
        self.token_gaps = [] if keep_gaps else None
        self.rounds = {}  # by engine request id
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

    def report(self, wall_s: float = 0.0) -> SimReport:
        return summarise(self, wall_s)


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
