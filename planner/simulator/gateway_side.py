"""The gateway's side of a simulation: each round bound, routed, queued and dispatched
as the live gateway does it, on its own pure core, and closed when its last token comes.

AMPD ("Efficient Multi-round LLM Inference over Disaggregated Serving"): a new session is
bound to a decode worker by ``rounds.binding``, each round is routed by
``rounds.policies.route`` (Alg. 1) on the windowed TTFT/ITL means and queued prefill
seconds, and a worker's prefill queue is served in the order ``rounds.policies.pick``
(Alg. 2) gives, with its slots - what gateway.queues commits to Redis, here in memory.
The hand-off is vLLM's: the prefill engine holds the prompt's blocks, the decode engine
pulls them (planner.simulator.engine_side) and decodes. KV usage for binding is scraped
every second as the gateway's pool does, without its HTTP delay.
"""

from __future__ import annotations

import math
from dataclasses import replace

from perfmodel.slo import Gaps
from planner.simulator.state import RoundState, SimSession, SimulationState, SimWorker
from rounds.binding import DecodeCandidate
from rounds.core import ITL, TTFT_REMOTE, Prompt, RoundResult, Signals, held_tokens
from rounds.engine.request import RemotePrefill, Request
from rounds.reordering import QueuedTask

SCRAPE_INTERVAL_S = 1.0  # the gateway's pool refresh (GatewayConfig.scrape_interval_s)
_FILLER = list(range(256)) * 512  # token ids to slice from (see GatewaySide._fresh_tokens)


class GatewaySide(SimulationState):
    """A ``Simulation``'s gateway: rounds in, routed and queued; answers back, rounds closed."""

    # -- gateway: a round becomes a routed, queued prefill task ------------------------
    def _start_round(self, session: SimSession) -> None:
        now = self.now
        self._scrape(now)
        spec = session.trace.rounds[session.next_round]
        session.tokens.extend(self._fresh_tokens(session, spec.input_tokens))
        l_total = len(session.tokens)
        prompt = None
        if self.config.placement != "memory":  # placement reads what every engine caches of the prompt
            candidates = {w.worker_id: w.candidate for w in self.workers.values()}
            prompt = Prompt(l_total, candidates, self._placement_signals(session, l_total))
        bound = self.core.bind(session.state, [
            DecodeCandidate(w.worker_id, w.kv_snapshot, w.profile.kv_capacity_tokens, self.arrivals.tokens[w.worker_id])
            for w in self.decoders
        ], holders=self.workers, prompt=prompt)  # fmt: skip
        arriving = l_total - bound.state.l_hist if bound.moved else 0  # what it caches there already stays
        if bound.moved:
            self.arrivals.expect(bound.state.decode_worker, arriving)
        session.state = state = bound.state
        decode = self.workers[state.decode_worker]
        prefills = [p.candidate for p in self.prefillers]
        signals = self._signals(decode) if prompt is None else prompt.signals
        candidate = replace(decode.candidate, colocates=True) if decode.assignment.colocates else decode.candidate
        plan = self.core.plan(state, f"t{next(self._ids)}", l_total, now, candidate, prefills, signals, self.config.slo)
        self.interval.arrived(plan.tokens, l_total)  # what the elastic controller forecasts from, as live
        decode.decoding += 1
        task = plan.task
        output_plan = self._fresh_tokens(session, spec.output_tokens)
        round_state = RoundState(session, plan, output_plan, arriving=arriving)
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

    def _placement_signals(self, session: SimSession, l_total: int) -> Signals:
        """The signals of every worker, with what each one's prefix cache holds of the round's
        prompt - exactly what an index fed by the engines' KV events would report."""
        now, mean, block_size = self.now, self.stats.mean, self.config.scheduler.block_size
        hashes = session.block_hashes(l_total, block_size)
        workers = self.workers.values()
        means = {(ITL, w.worker_id): mean(ITL, w.worker_id, now) for w in self.decoders}
        means.update(((TTFT_REMOTE, p.worker_id), mean(TTFT_REMOTE, p.worker_id, now)) for p in self.prefillers)
        return Signals(
            {w.worker_id: w.queue.cost for w in workers},
            {k: v for k, v in means.items() if v is not None},
            {w.worker_id: w.queue.tokens for w in workers},
            cached_tokens={
                w.worker_id: len(w.scheduler.kv.find_cached_prefix(hashes, l_total)) * block_size for w in workers
            },
            waiting={w.worker_id: len(w.queue.tasks) for w in workers},
            running={w.worker_id: w.decoding + w.remote_prefills for w in workers},
        )

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
        if self.token_gaps is not None:
            self.token_gaps.extend(state.gaps)
        session.state = closed.state
        session.tokens.extend(request.output_token_ids)
        spec = session.trace.rounds[session.next_round]
        session.next_round += 1
        if session.next_round < len(session.trace.rounds):
            self._at(self.now + spec.tool_latency_s, self._start_round, session)
        else:  # done: its conversation (tens of MB over a long trace) is not needed any more
            session.tokens = []
            self._unfinished -= 1
