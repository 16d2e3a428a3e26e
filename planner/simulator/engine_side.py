"""The engines' side of a simulation: every worker's ``rounds.engine.scheduler.Scheduler``
(the GPU-free engine's core: continuous batching, chunked prefill, paged KV with prefix
caching, preemption, NixlConnector-style holds and pulls) stepped in virtual time with
fused decode steps, and the KV a decode engine pulls from the prefill engine that
computed it (T_kv on the alpha-beta model, perfmodel.profile.t_kv).

Work that arrives at an engine in the middle of a fused decode step is looked at once,
at the sub-step boundary where a real engine would next schedule; a request that only
waits there for its prompt's KV joins without ending the step
(``Scheduler.admit_during``).
"""

from __future__ import annotations

from bisect import bisect_left

from perfmodel.profile import t_kv
from planner.simulator.state import SimulationState, SimWorker
from rounds.engine.scheduler import KVLoad


class EngineSide(SimulationState):
    """A ``Simulation``'s engines: steps started, cut and ended as events; KV pulled between them."""

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
            same_node = source.candidate.node == worker.candidate.node
            done = self.now + t_kv(load.num_tokens, source.profile, worker.profile, same_node)
            self._at(done, self._kv_loaded, worker, load.request.request_id, source, remote.request_id)

    def _end_step(self, worker: SimWorker, version: int) -> None:
        if version != worker.version or worker.step is None:
            return  # a step cut short: its new end is another event
        step, start = worker.step, worker.step_start
        worker.step = None
        worker.busy_s += step.duration
        worker.prefill_tokens += sum(n for _, n in step.prefills)
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
