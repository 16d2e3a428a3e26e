"""The elastic controller (rounds.elastic) in a simulation, on the same events as live.

An elastic pool's engines change role as the load moves: the controller ticks every
``interval_s`` on the engines' state (queued prefill seconds, rounds decoding, KV use,
windowed ITL) and moves engines between the prefill and decode roles, draining what a
move leaves (rounds.roles), and every ``forecast_interval_s`` it observes the demand
counted since the last (gateway.elastic_live.DemandLog's counts). The roles over time
go into the report.
"""

from __future__ import annotations

from planner.simulator.report import RolesAt
from planner.simulator.state import ForecastInterval, SimulationState
from rounds.core import ITL
from rounds.elastic import EngineState
from rounds.roles import counts, settle
from rounds.roles import move as move_to


class ElasticControl(SimulationState):
    """A ``Simulation``'s elastic controller: its ticks and forecasts as events."""

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
        self.interval = ForecastInterval()
        if self._unfinished:
            self._at(self.now + interval, self._forecast)

    def _record_roles(self) -> None:
        self.timeline.append(RolesAt(at=self.now, **counts(w.assignment for w in self.workers.values())))
