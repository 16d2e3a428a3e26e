"""Running one round over the engines: the I/O shell around the round core.

The core (rounds.core) decides where a round's prefill runs and what the finished
round changes; this module does what that takes: it binds the session through the
worker pool, waits in the routed worker's prefill queue (gateway.state.prefill_queue, Alg. 2),
runs vLLM's hand-off (remote: the prefill worker, then the decode worker with the KV
transfer params; local: the decode worker alone), relays the decode stream while
measuring it, moves a stream whose decode worker dies (gateway.engines.migration), and writes
what the core says the round changed: the session's state, the windowed statistics,
the round's record and spans.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis

from gateway.apis.schema import APIError
from gateway.elastic_live import DemandLog
from gateway.engines.migration import Continued, Transform, continuation_body, resumable, round_usage, with_tokens_left
from gateway.engines.pool import LiveWorker, WorkerPool
from gateway.engines.upstream import EngineClient, Reply, UpstreamError
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.state.failover import Failover
from gateway.state.outage import REDIS_DOWN, RedisHealth
from gateway.state.prefill_queue import PrefillQueues, QueueFull
from gateway.state.redis_batch import RedisBatch
from gateway.state.sessions import SessionStore, round_key, shallow
from gateway.state.stats import WindowedStats
from gateway.tool_loop import ClientView
from gateway.tracing import RoundTimes, RoundTracer
from perfmodel.slo import Gaps
from rounds.core import (
    Bound,
    Candidate,
    Prompt,
    RoundCore,
    RoundPlan,
    RoundRecord,
    RoundResult,
    SessionState,
    Signals,
)

log = logging.getLogger(__name__)


@dataclass
class Round:
    """One round in flight: the core's plan and what running it has done so far."""

    plan: RoundPlan
    decode: LiveWorker  # the worker decoding it now (another one after a migration)
    arriving: int = 0  # prompt tokens expected at ``decode``, newly bound (rounds.binding.Arrivals)
    migrations: int = 0
    times: RoundTimes = field(default_factory=lambda: RoundTimes(time.time()))
    index: int = 1  # its place in the exchange: server tool rounds follow the first
    indexed: dict[str, int] | None = None  # prompt tokens each engine holds, as the KV index saw at planning
    route: Literal["local", "remote"] = field(init=False)  # as run: a remote prefill that fails runs locally

    def __post_init__(self) -> None:
        self.route = self.plan.route.kind


def ledger_entries(plan: RoundPlan, decode_worker: str) -> list[tuple[str, str]]:
    """A round's entries in the round ledger (gateway.state.round_ledger): (worker, entry)."""
    task_id, entries = plan.task.task_id, [(decode_worker, plan.task.task_id)]
    if plan.route.kind == "remote":
        entries.append((plan.route.worker_id, f"{task_id}:prefill"))
    return entries


class Holds:
    """What a running round holds, each let go exactly once, at the latest when it ends:
    its prefill slot (until its prefill is over), its arriving tokens (until its KV
    reaches the decode worker) and its entries in the round ledger (a remote prefill's
    until it answers, the round's until it ends; gateway.state.round_ledger)."""

    def __init__(self, queues: PrefillQueues, pool: WorkerPool, r: Round) -> None:
        self.queues, self.pool, self.r = queues, pool, r
        self.slot: str | None = None  # the worker whose prefill slot the round holds
        # The round's ledger entry, then its remote prefill's (they stay through a migration).
        self.entries = ledger_entries(r.plan, r.decode.info.worker_id)
        self.prefilling = len(self.entries) > 1

    def prefill_over(self) -> None:
        if self.slot is not None:
            self.queues.release(self.slot, self.r.plan.task.task_id)
            self.slot = None
        if self.prefilling:
            self.queues.ledger_end(*self.entries[1])
            self.prefilling = False

    def landed(self) -> None:
        if self.r.arriving:
            self.pool.arrivals.landed(self.r.decode.info.worker_id, self.r.arriving)
            self.r.arriving = 0

    async def __aenter__(self) -> Holds:
        await self.queues.ledger.start(*self.entries)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.prefill_over()
        self.landed()
        self.queues.ledger_end(*self.entries[0])


class RoundRunner:
    def __init__(
        self,
        core: RoundCore,
        pool: WorkerPool,
        queues: PrefillQueues,
        client: EngineClient,
        metrics: GatewayMetrics,
        migration_limit: int,
        recorder: RoundRecorder,
    ) -> None:
        self.core, self.pool, self.queues, self.client, self.metrics = core, pool, queues, client, metrics
        self.migration_limit, self.recorder = migration_limit, recorder

    # -- before the round: binding and the plan -------------------------------------------
    def bind(
        self,
        state: SessionState | None,
        model: str,
        l_total: int,
        keeps_history: bool = True,
        signals: Signals | None = None,
    ) -> Bound:
        """The session's decode worker (rounds.core.RoundCore.bind): where the signals say
        what the engines cache of the prompt (a placement by the KV index), placed by them;
        a newly bound one expects what it does not cache of the round's prompt.
        ``ValueError``: no decode worker is left."""
        prompt = None
        if signals is not None and signals.cached_tokens:
            workers = self.pool.decoders(model) + self.pool.prefillers(model, exclude="")
            prompt = Prompt(l_total, {w.info.worker_id: self._candidate(w) for w in workers}, signals)
        bound = self.core.bind(state, self.pool.decode_candidates(model), keeps_history, self.pool.workers, prompt)
        if bound.moved:
            self.pool.arrivals.expect(bound.state.decode_worker, l_total - bound.state.l_hist)
        return bound

    def plan(self, ex: Exchange, bound: Bound, l_total: int, created_at: float, signals: Signals) -> Round:
        """The core's plan for the session's next round, on the workers as the pool sees them."""
        pool, model = self.pool, ex.body["model"]
        decode = pool.get(bound.state.decode_worker)
        if decode is None:
            raise APIError(503, f"decode worker {bound.state.decode_worker} left the pool", code="no_worker")
        prefills = [self._candidate(p) for p in pool.prefillers(model, exclude=decode.info.worker_id)]
        started = time.perf_counter()
        plan = self.core.plan(
            bound.state, secrets.token_hex(16), l_total, created_at, self._candidate(decode), prefills, signals, ex.slo
        )
        self.metrics.decision.observe(time.perf_counter() - started)
        self.metrics.routes.labels(plan.route.kind, plan.route.reason).inc()
        self.queues.ledger.placed(*ledger_entries(plan, decode.info.worker_id))  # rounds after it see it at once
        return Round(plan, decode, arriving=l_total if bound.moved else 0)

    def _candidate(self, worker: LiveWorker) -> Candidate:
        info, mixed = worker.info, worker.assignment is not None and worker.assignment.colocates
        return Candidate(info.worker_id, info.profile, info.speed, prefill_chunk=info.prefill_chunk,
                         colocates=mixed, splits=info.splits, node=info.node,
                         prefill_factor=info.prefill_factor)  # fmt: skip

    # -- the round ----------------------------------------------------------------------
    async def run(self, ex: Exchange, r: Round, reply: Reply, view: ClientView | None) -> AsyncIterator[bytes]:
        """Queue, prefill and decode one round; yields what the client gets of it."""
        plan, times = r.plan, r.times
        await self.recorder.arrived(r)
        async with Holds(self.queues, self.pool, r) as holds:
            try:
                dispatched = await self.queues.submit(
                    plan.route.worker_id, plan.task, plan.estimate_s, ex.slo.ttft_s, plan.tokens
                )
            except QueueFull as exc:
                raise APIError(429, str(exc), code="queue_full") from exc
            holds.slot = plan.route.worker_id
            times.queued_s, times.dispatched_at = dispatched.queued_s, time.time()
            self.metrics.queue_wait.observe(dispatched.queued_s)
            request_id = secrets.token_hex(16)
            body = ex.engine_body()
            if r.route == "remote":
                body = await self._prefill(r, body, request_id)
                holds.prefill_over()
            times.decode_sent_at = time.time()
            async for events in self._decode(ex, r, body, request_id, reply, view):
                yield events
                holds.landed()
                holds.prefill_over()  # the first token is out: a local prefill is over
            holds.prefill_over()  # nothing was relayed this round (a hidden tool call)
            await self.recorder.record(ex, r, reply)

    async def _prefill(self, r: Round, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """vLLM's hand-off, first half: the body for the decode worker, with the KV transfer
        params; a prefill worker that fails or is gone leaves the round to prefill locally."""
        worker_id = r.plan.route.worker_id
        prefill = self.pool.get(worker_id)
        try:
            if prefill is None:
                raise UpstreamError(f"prefill worker {worker_id} left the pool")
            params = await self.client.prefill(prefill.info.url, body, request_id, r.plan.route.split_at)
        except UpstreamError as exc:
            if 400 <= exc.status < 500:
                raise
            log.warning("remote prefill on %s failed (%s); prefilling locally", worker_id, exc)
            if exc.lost:  # no new round goes there until it answers a scrape again
                self.pool.forget(worker_id)
            self.metrics.routes.labels("local", "fallback").inc()
            r.route = "local"
            return body
        r.times.prefilled_at = time.time()
        return dict(body, kv_transfer_params=params)

    async def _decode(
        self, ex: Exchange, r: Round, body: dict[str, Any], request_id: str, reply: Reply, view: ClientView | None
    ) -> AsyncIterator[bytes]:
        """The round's decode stream; when its worker is lost mid-stream, the stream goes on
        on another decode worker (gateway.engines.migration), up to the migration limit."""
        transform: Transform | None = view
        leg, limit = body, self.migration_limit
        while True:
            try:
                async for events in self.client.stream(
                    r.decode.info.url, leg, request_id, reply, ex.wants_usage, transform
                ):
                    yield events
                break
            except UpstreamError as exc:
                if not exc.lost or not resumable(reply):
                    raise
                if r.migrations >= limit:
                    self.metrics.migrations.labels("refused").inc()
                    raise UpstreamError(f"{exc}; not moved: migration limit {limit}") from exc
                leg, transform = await self._migrate(ex, r, body, reply, view, exc)
                request_id = secrets.token_hex(16)
        if r.migrations and reply.usage is not None:
            reply.usage = round_usage(reply.usage, r.plan.task.l_total)

    async def _migrate(
        self, ex: Exchange, r: Round, body: dict[str, Any], reply: Reply, view: ClientView | None, cause: UpstreamError
    ) -> tuple[dict[str, Any], Transform | None]:
        """Re-bind the session off its lost decode worker (``cause``: how it was lost); the
        request and chunk rewriter that continue the round there."""
        lost, model, l_total = r.decode.info.worker_id, ex.body["model"], r.plan.task.l_total
        self.pool.forget(lost)
        try:
            bound = self.bind(ex.session.state, model, l_total)
        except ValueError as exc:
            raise UpstreamError(f"decode worker {lost} was lost ({cause}) and no other is left", 503) from exc
        ex.rebound(bound)
        r.decode, r.arriving, r.migrations = self.pool.workers[bound.state.decode_worker], l_total, r.migrations + 1
        leg = continuation_body(body, reply)
        if reply.content:
            url, tools = r.decode.info.url, ex.engine_tools
            prompt = await self.client.tokenize(url, model, leg["messages"], tools, continue_final_message=True)
            leg = with_tokens_left(leg, prompt - l_total)
        self.metrics.migrations.labels("moved").inc()
        log.warning("session %s: decode worker %s lost mid-stream, continuing on %s", ex.session.session_id, lost,
                    bound.state.decode_worker)  # fmt: skip
        if reply.head is None:  # nothing reached the client: the round simply starts over
            return leg, view
        return leg, Continued(reply.head, l_total, ex.wants_usage, view)


def indexed_cached_tokens(r: Round) -> int | None:
    """The prompt tokens the KV index said the engine that prefilled the round held (None
    where the index had no view: no events, or no token ids for the model)."""
    if r.indexed is None:
        return None
    prefilled_on = r.plan.route.worker_id if r.route == "remote" else r.decode.info.worker_id
    return r.indexed.get(prefilled_on)


class RoundRecorder:
    """After a round: what the core says it changed, written where it is kept."""

    def __init__(
        self,
        core: RoundCore,
        redis: aioredis.Redis,
        batch: RedisBatch,
        failover: Failover,
        stats: WindowedStats,
        sessions: SessionStore,
        tracer: RoundTracer,
        metrics: GatewayMetrics,
        health: RedisHealth,
        demand: DemandLog | None = None,
    ) -> None:
        self.core, self.redis, self.batch, self.stats, self.sessions = core, redis, batch, stats, sessions
        self.failover = failover
        self.tracer, self.metrics, self.health, self.demand = tracer, metrics, health, demand

    async def arrived(self, r: Round) -> None:
        """A round arrived: the load the elastic controller forecasts from, where it runs."""
        if self.demand is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        self.demand.arrived(pipe, r.plan.tokens, r.plan.task.l_total, time.time())
        await self._send(pipe, "round demand")

    async def record(self, ex: Exchange, r: Round, reply: Reply) -> None:
        """What the core says the round changed: the session's state, the windowed
        statistics, the round's record (``GET /v1/sessions/{id}``) and its spans. The
        writes are staged on ``ex.writes``, for :meth:`flush` or the exchange's close."""
        session, task, times, usage = ex.session, r.plan.task, r.times, reply.usage or {}
        first = reply.first_token_at
        prefilled = times.prefilled_at if r.route == "remote" else first
        result = RoundResult(
            route=r.route,
            decode_worker=r.decode.info.worker_id,
            ttft_s=reply.ttft_s,
            gaps=Gaps.of(reply.itl),
            prompt_tokens=int(usage.get("prompt_tokens", task.l_total)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            queue_wait_s=times.queued_s,
            prefill_s=None if prefilled is None else prefilled - task.created_at,
            migrations=r.migrations,
        )
        closed = self.core.close(session.session_id, session.state, r.plan, result, ex.slo)
        session.state = closed.state
        self._trace(ex, r, reply, closed.record)
        # Staged, not sent: the exchange sends them with its own writes (gateway.coordinator),
        # one round trip to close a round instead of two.
        pipe = ex.writes if ex.writes is not None else self.redis.pipeline(transaction=False)
        self.stats.record(pipe, closed.observations)
        entry = dict(shallow(closed.record), indexed_cached_tokens=indexed_cached_tokens(r))
        self.sessions.record_round(pipe, session, entry, round_key(ex.request_hash, r.index))
        if self.demand is not None:  # what the elastic controller forecasts from
            self.demand.finished(pipe, closed.record.completion_tokens, time.time())
        ex.writes = pipe
        record = closed.record
        if record.ttft_s is not None:
            self.metrics.ttft.labels(record.kind).observe(record.ttft_s)
        if record.mean_itl_s is not None:
            self.metrics.itl.observe(record.mean_itl_s)
        for rule, met in record.slo_met.items():
            self.metrics.slo_rounds.labels(rule, "met" if met else "missed").inc()

    async def flush(self, ex: Exchange, what: str = "round record") -> None:
        """Send the writes staged on ``ex.writes``: kept through a failover of a Sentinel-managed
        Redis (gateway.state.failover), else lost, not fatal, while Redis is away."""
        pipe, ex.writes = ex.writes, None
        if pipe is not None:
            await self.failover.close(pipe, what)

    async def _send(self, pipe: aioredis.client.Pipeline, what: str) -> None:
        """Writes of shared state, with other rounds' commands: lost, not fatal, while Redis is away."""
        try:
            await self.batch.pipeline(pipe)
        except REDIS_DOWN as exc:
            self.health.failed(what, exc)

    def _trace(self, ex: Exchange, r: Round, reply: Reply, record: RoundRecord) -> None:
        """The round's spans (gateway.tracing), under the session's span."""
        session = ex.session
        end = reply.last_token_at or time.time()
        first = reply.first_token_at or end
        if not session.trace_id:
            started = session.created or r.plan.task.created_at
            session.trace_id, session.span_id = self.tracer.session(session.session_id, session.scope, started, end)
        self.tracer.round((session.trace_id, session.span_id), record, r.times, first, end)
