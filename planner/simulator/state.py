"""The pieces of the live system that hold state, kept in memory (planner.simulator).

Each stands for what the gateway keeps in Redis or an engine keeps itself: a worker's
prefill queue and slots, a worker with its scheduler and role, a session's conversation
and its round core state, a round in flight, the demand counted for the elastic
controller's forecast. ``SimulationState`` is all of it together, as the sides of a
``Simulation`` (planner.simulator.loop) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from perfmodel.profile import Profile
from planner.trace import TraceSession
from rounds.core import Candidate, RoundPlan, SessionState
from rounds.elastic import Demand
from rounds.engine.scheduler import Scheduler, Step
from rounds.reordering import QueuedTask
from rounds.roles import Assignment, Role, busy

if TYPE_CHECKING:
    from planner.simulator.config import SimConfig
    from planner.simulator.report import RolesAt
    from rounds.binding import Arrivals
    from rounds.core import RoundCore, RoundRecord
    from rounds.elastic import ElasticController, Move
    from rounds.windowed import WindowedMeans


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
    prefill_tokens: int = 0  # prompt tokens its steps computed (cache hits and pulled KV not counted)

    def busy_with(self) -> set[Role]:
        """The roles whose work it still has (rounds.roles: what a move leaves draining)."""
        return busy(self.remote_prefills > 0, self.decoding > 0)


@dataclass
class SimSession:
    trace: TraceSession
    index: int  # the session's number: its token ids are unique to it
    # Its shared prefix (planner.trace.SharedPrefix) as (the token its segment ends at, the
    # number of the segments up to it): blocks that end within one are the same in every
    # session whose prefix starts with the same segments.
    shared: tuple[tuple[int, int], ...] = ()
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
        and evicts exactly as it would, without hashing every block of every round. A
        block within the shared prefix stands for (the prefix's segments up to the one
        it ends in, position) instead - negative keys, apart from every session's - which
        every session of that agent type (and tenant) shares."""
        first = (self.index + 1) << 32
        count = num_tokens // block_size
        keys: list[int] = []
        segment = 0
        for i in range(min(count, self.shared[-1][0] // block_size if self.shared else 0)):
            last = (i + 1) * block_size - 1
            while self.shared[segment][0] <= last:
                segment += 1
            keys.append(-((self.shared[segment][1] + 1) << 32) - i)
        return keys + list(range(first + len(keys), first + count))


def shared_prefix(session: TraceSession, chains: dict[tuple[str, ...], int]) -> tuple[tuple[int, int], ...]:
    """``session``'s shared prefix as ``SimSession.shared``, numbering each new run of segment
    keys in ``chains`` (kept across the run's sessions)."""
    out, end, keys = [], 0, ()
    for segment in session.prefix:
        end, keys = end + segment.tokens, (*keys, segment.key)
        out.append((end, chains.setdefault(keys, len(chains))))
    return tuple(out)


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
class ForecastInterval:
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


class SimulationState:
    """What the sides of a simulation share, set up by ``Simulation.__init__``
    (planner.simulator.loop): the gateway side, the engine side and the elastic control
    read and write it, and call one another's methods by name."""

    config: SimConfig
    core: RoundCore  # the gateway's pure core (rounds.core)
    stats: WindowedMeans
    controller: ElasticController | None  # elastic pools only
    workers: dict[str, SimWorker]
    decoders: list[SimWorker]  # the engines sessions are bound to, as the roles stand
    prefillers: list[SimWorker]  # the engines others' sessions prefill on
    sessions: list[SimSession]
    records: list[RoundRecord]
    token_gaps: list[float] | None  # every round's inter-token gaps, where the run keeps them
    rounds: dict[str, RoundState]  # by engine request id
    arrivals: Arrivals  # bound sessions' prompts no scrape shows yet (rounds.binding)
    interval: ForecastInterval
    timeline: list[RolesAt]
    moves: list[tuple[float, Move]]
    now: float
    _unfinished: int  # sessions with rounds still to come
