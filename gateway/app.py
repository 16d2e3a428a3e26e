"""The coordinator: an OpenAI-compatible front that schedules every round's prefill.

The life of a round (shared/DESIGN.md): find the session (gateway.sessions) and its
bound decode worker, binding new sessions (gateway.binding); count the prompt with the
engine's ``/tokenize``; turn the round into a prefill task with l_hist and l_incr;
route it (gateway.policies, AMPD Alg. 1 by default); wait in the chosen worker's
prefill queue (gateway.queues, Alg. 2); run it with vLLM's hand-off (remote: prefill
worker, then decode worker with the KV transfer params; local: the decode worker
alone); stream the reply back while measuring TTFT and ITL into the shared windowed
statistics (gateway.stats); and remember what the decode worker now holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.api import APIError, ChatRequest, check_tool_messages, validation_error
from gateway.binding import DecodeCandidate, choose_decode_worker
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.migration import Continued, Transform, continuation_body, resumable, round_usage, with_tokens_left
from gateway.outage import REDIS_DOWN, RedisHealth
from gateway.policies import POLICIES, route
from gateway.pool import LiveWorker, WorkerPool
from gateway.queues import PrefillQueues, QueueFull
from gateway.routing import PrefillTask, Route, WorkerView
from gateway.sessions import Session, SessionStore, continues, conversation_hashes, explicit_session_id, new_session
from gateway.stats import WindowedStats
from gateway.tool_loop import ClientView, announcement, round_summary, tool_messages
from gateway.tracing import RoundTracer
from gateway.upstream import EngineClient, Reply, UpstreamError
from perfmodel.slo import SLO, derived_slo
from tools_sandbox.client import ToolRunner
from tools_sandbox.outcome import Outcome
from tools_sandbox.registry import TOOLS, openai_tool

log = logging.getLogger(__name__)
content_log = logging.getLogger("ampd.content")  # prompts and replies: only with config.log_content
PUBLIC_SCOPE = "public"  # the one scope of a gateway without API keys
REDIS_CONNECTIONS = 256
# Load signals of candidate workers: queued prefill seconds, and windowed (series, worker) means.
Signals = tuple[dict[str, float], dict[tuple[str, str], float]]


@dataclass
class Exchange:
    """One client request; several engine rounds when server-side tools run."""

    arrival: float
    scope: str
    body: dict[str, Any]  # the client's body, model resolved
    client_messages: list[dict[str, Any]]
    engine_messages: list[dict[str, Any]]  # what the engine sees: the session's transcript spliced in
    engine_tools: list[dict[str, Any]] | None  # the client's tools plus the enabled server tools
    server_tools: frozenset[str]
    session: Session
    slo: SLO
    wants_usage: bool
    arriving: int  # prompt tokens expected at the session's decode worker, newly bound (gateway.binding)
    rounds: list[dict[str, Any]] = field(default_factory=list)  # server tool rounds, for the client

    def engine_body(self) -> dict[str, Any]:
        body = {k: v for k, v in self.body.items() if k != "server_tools"}
        body["messages"] = self.engine_messages
        if self.engine_tools:
            body["tools"] = self.engine_tools
        if self.scope != PUBLIC_SCOPE:  # tenants share no prefix-cache block, so none can probe another's prompts
            salt = self.body.get("cache_salt")
            body["cache_salt"] = f"{self.scope}:{salt}" if salt else self.scope
        return body


@dataclass
class RoundTimes:
    """When a round's phases happened (wall clock), for its record and its spans."""

    queued_at: float
    queued_s: float = 0.0  # the queue's own measure, enqueue to dispatch
    dispatched_at: float = 0.0
    prefilled_at: float | None = None  # remote rounds: the prefill worker answered
    decode_sent_at: float = 0.0


@dataclass
class Round:
    """One prefill task and the decode that follows it."""

    task: PrefillTask
    route: Route
    decode: LiveWorker  # the worker decoding it now (another one after a migration)
    migrations: int = 0


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        # Block for a free connection rather than fail when hundreds of requests are in flight.
        # A connection Redis dropped (a restart) fails on first use: it is opened again and
        # the command sent once more - a write on a dead socket never reached Redis, so the
        # retry cannot apply it twice. (With a pool of its own, redis-py retries nothing.)
        pool = aioredis.BlockingConnectionPool.from_url(
            config.redis_url, decode_responses=True, max_connections=REDIS_CONNECTIONS, timeout=10,
            retry=Retry(NoBackoff(), 1), retry_on_error=[aioredis.ConnectionError],
        )  # fmt: skip
        self.redis = aioredis.Redis(connection_pool=pool)
        self.client = EngineClient(config.request_timeout_s)
        self.metrics = GatewayMetrics(postponements=lambda: self.queues.postponements)
        self.health = RedisHealth(self.metrics.redis_up, self.metrics.redis_errors)
        self.pool = WorkerPool(self.redis, config.key_prefix, config.static_workers, self.client, self.health)
        self.stats = WindowedStats(self.redis, config.key_prefix, config.stats_window_s, self.health)
        self.sessions = SessionStore(self.redis, config.key_prefix, config.session_ttl_s, self.health)
        self.policy = POLICIES[config.policy]
        self.queues = PrefillQueues(
            self.redis,
            config.key_prefix,
            config.replica_id,
            self.policy,
            window=config.reorder_window,
            slots=config.prefill_slots,
            max_queue=config.max_queue,
            task_ttl_s=config.session_ttl_s,
            health=self.health,
        )
        self.rng = random.Random(config.routing_seed)
        self.key_hashes = config.key_hashes
        self.tools = ToolRunner(config.redis_url, config.key_prefix)
        self.tracer = RoundTracer()
        self._refresher: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self.pool.refresh()
        self.queues.watch(self.pool.workers)
        await self.queues.start()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="pool-refresh")

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        await self.queues.stop()
        await self.client.close()
        self.tools.close()
        await self.redis.aclose()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.scrape_interval_s)
            await self.pool.refresh()
            self.queues.watch(self.pool.workers)

    # -- requests ----------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str:
        """The caller's scope: sessions, hashes and ids are namespaced by it."""
        if not self.key_hashes:
            return PUBLIC_SCOPE
        key = (authorization or "").removeprefix("Bearer ").strip()
        digest = hashlib.sha256(key.encode()).hexdigest()
        if not key or digest not in self.key_hashes:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return digest[:16]

    def slo_for(self, model: str) -> SLO:
        worker = self.pool.decoders(model)[0].info
        derived = derived_slo(worker.profile, self.config.slo_scale).scaled(worker.speed)
        return SLO(self.config.ttft_slo_s or derived.ttft_s, self.config.itl_slo_s or derived.itl_s)

    def resolve_model(self, requested: str | None) -> str:
        models = self.pool.models()
        if requested is None and len(models) == 1:
            return models[0]
        if requested is None:
            raise APIError(400, "model is required", param="model")
        if requested not in models:
            if not models:
                raise APIError(503, "no worker is available", code="no_worker")
            raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        if not self.pool.decoders(requested):
            raise APIError(503, f"no decode worker is available for {requested}", code="no_worker")
        return requested

    async def open(self, raw: dict[str, Any], headers: dict[str, str], scope: str) -> tuple[Exchange, Round]:
        """Everything before the first prefill runs: session, binding, counting, routing."""
        arrival = time.time()
        try:
            request = ChatRequest.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        check_tool_messages(request.messages)
        model = self.resolve_model(request.model)
        server_tools = self._enabled_tools(request)
        engine_tools = (raw.get("tools") or []) + [openai_tool(TOOLS[name]) for name in sorted(server_tools)]
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        hashes = conversation_hashes(scope, messages)
        explicit = explicit_session_id(headers, raw)
        decoders = self.pool.decoders(model)
        # One concurrent stage: the session, the prompt's length, and the load signals of
        # every worker the round could go to (which one it is depends on the first two).
        found, l_total, signals = await asyncio.gather(
            self._find_session(scope, explicit, hashes),
            self._count(model, messages, engine_tools or None),
            self._signals({w.info.worker_id for w in decoders + self.pool.prefillers(model, exclude="")}),
        )
        session, transcript = found
        extends = session is not None and continues(session, hashes)
        engine_messages = messages
        if extends and transcript is not None:  # server tool rounds the client never saw
            engine_messages = transcript + messages[session.conversation_len :]
            l_total = await self._count(model, engine_messages, engine_tools or None)
        session, arriving = self._bind(session, scope, explicit, model, l_total)
        if not extends:  # new, or the client rewrote its history: nothing cached counts
            session.l_hist = 0
        wants_usage = bool(request.stream_options and request.stream_options.include_usage) or not request.stream
        exchange = Exchange(
            arrival, scope, dict(raw, model=model), messages, engine_messages, engine_tools or None,
            server_tools, session, self.slo_for(model), wants_usage, arriving,
        )  # fmt: skip
        return exchange, self.plan(exchange, arrival, l_total, signals)

    async def _count(self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        """The prompt's length in tokens, from the least loaded decode worker. One that is
        lost (killed since its last scrape) is left out of the pool and the next one asked."""
        lost: UpstreamError | None = None
        for worker in sorted(self.pool.decoders(model), key=lambda w: w.load.kv_usage):
            try:
                return await self.client.tokenize(worker.info.url, model, messages, tools)
            except UpstreamError as exc:
                if not exc.lost:
                    raise
                self.pool.forget(worker.info.worker_id)
                lost = exc
        raise lost or UpstreamError(f"no decode worker is available for {model}", 503)

    async def _signals(self, worker_ids: set[str]) -> Signals:
        """Queued prefill seconds and windowed TTFT/ITL of the given workers."""
        wanted = [(series, w) for w in worker_ids for series in ("itl", "ttft")]
        costs, means = await asyncio.gather(self.queues.queue_costs(worker_ids), self.stats.means(wanted))
        return costs, means

    def _enabled_tools(self, request: ChatRequest) -> frozenset[str]:
        wanted = frozenset(request.server_tools or ())
        unknown = wanted - set(self.config.server_tools)
        if unknown:
            raise APIError(400, f"server_tools not offered by this gateway: {sorted(unknown)}", param="server_tools")
        clashing = wanted & {t.function.name for t in request.tools or []}
        if clashing:
            raise APIError(400, f"tools named like server tools: {sorted(clashing)}", param="tools")
        return wanted

    def plan(
        self,
        ex: Exchange,
        created_at: float,
        l_total: int,
        signals: Signals,
    ) -> Round:
        """A prefill task for the session's next round, and where it runs."""
        session = ex.session
        decode = self.pool.get(session.decode_worker)
        if decode is None:
            raise APIError(503, f"decode worker {session.decode_worker} left the pool", code="no_worker")
        l_hist = min(session.l_hist, l_total - 1)
        task = PrefillTask(uuid.uuid4().hex, session.session_id, l_hist, l_total, created_at)
        return Round(task, self._route(task, session, decode, decode.info.model, ex.slo, signals), decode)

    async def _find_session(
        self, scope: str, explicit: str | None, hashes: list[str]
    ) -> tuple[Session | None, list[dict[str, Any]] | None]:
        """The request's session, and its transcript if server-side rounds made one."""
        session_id = explicit or await self.sessions.infer(scope, hashes)
        if session_id is None:
            return None, None
        session = await self.sessions.load(scope, session_id)
        if session is None or not session.has_transcript:
            return session, None
        return session, await self.sessions.transcript(scope, session_id)

    def _bind(
        self, session: Session | None, scope: str, explicit: str | None, model: str, l_total: int
    ) -> tuple[Session, int]:
        """AMPD step 1 for new sessions, and re-binding for sessions whose worker is gone
        or draining (their next round prefills the whole history on the new worker).
        Also the prompt tokens now expected at a newly bound worker (0: it stayed)."""
        if session is not None and self.pool.serving(session.decode_worker) is not None:
            return session, 0
        arriving = self.pool.arriving
        candidates = [
            DecodeCandidate(w.info.worker_id, w.load.kv_usage, w.info.kv_capacity_tokens, arriving[w.info.worker_id])
            for w in self.pool.decoders(model)
        ]
        worker_id = choose_decode_worker(candidates)
        self.pool.expect(worker_id, l_total)
        if session is None:
            self.metrics.sessions.inc()
            bound = new_session(explicit or uuid.uuid4().hex, scope, worker_id, explicit_id=explicit is not None)
            return bound, l_total
        log.info("session %s re-bound from %s to %s", session.session_id, session.decode_worker, worker_id)
        session.decode_worker, session.l_hist, session.conversation_len = worker_id, 0, 0
        return session, l_total

    def _route(
        self,
        task: PrefillTask,
        session: Session,
        decode: LiveWorker,
        model: str,
        slo: SLO,
        signals: Signals,
    ) -> Route:
        costs, means = signals
        prefillers = (
            self.pool.prefillers(model, exclude=decode.info.worker_id) if self.policy.uses_prefill_workers else []
        )

        def view(w: LiveWorker, **kw: Any) -> WorkerView:
            i = w.info
            # A worker that (re)joined the pool since the signals were read has no queue there yet.
            return WorkerView(i.worker_id, i.profile, i.speed, queue_cost=costs.get(i.worker_id, 0.0), **kw)

        decode_view = view(decode, windowed_itl=means.get(("itl", decode.info.worker_id)))
        prefill_views = [
            view(
                p,
                windowed_ttft=means.get(("ttft", p.info.worker_id)),
                cached_tokens=session.prefill_cached if p.info.worker_id == session.prefill_worker else 0,
            )
            for p in prefillers
        ]
        started = time.perf_counter()
        chosen = route(
            self.policy, task, decode_view, prefill_views, slo, self.config.alpha, self.config.beta, self.rng
        )
        self.metrics.decision.observe(time.perf_counter() - started)
        self.metrics.routes.labels(chosen.kind, chosen.reason).inc()
        return chosen

    def _estimate(self, session: Session, r: Round) -> float:
        """t_pre of the task on the worker it was routed to (what its queue will hold)."""
        task = r.task
        if r.route.kind == "local":
            return r.decode.info.profile.t_pre(task.l_hist, task.l_incr) / r.decode.info.speed
        worker = self.pool.get(r.route.worker_id)
        assert worker is not None
        cached = min(session.prefill_cached, task.l_total - 1) if session.prefill_worker == r.route.worker_id else 0
        return worker.info.profile.t_pre(cached, task.l_total - cached) / worker.info.speed

    async def converse(self, ex: Exchange, first: Round, client: Reply) -> AsyncIterator[bytes]:
        """Run the exchange's rounds; yields the SSE events the client gets and fills
        ``client`` (what a non-streaming client gets). Without server-side tools this
        is one round relayed as it is; with them, every round whose calls are all
        server-side is followed by the tools and another round (gateway.tool_loop)."""
        r, usage = first, {"prompt_tokens": 0, "completion_tokens": 0}
        for index in range(1, self.config.max_tool_rounds + 2):
            engine = Reply(started=r.task.created_at) if ex.server_tools else client
            view = ClientView(ex.server_tools, engine, client, index > self.config.max_tool_rounds)
            async for events in self.run_round(ex, r, engine, view if ex.server_tools else None):
                yield events
            for key in usage:
                usage[key] += int((engine.usage or {}).get(key, 0))
            calls = view.server_calls() if ex.server_tools else []
            message = engine.message()
            if calls and index > self.config.max_tool_rounds:  # out of rounds: the calls go unanswered
                message.pop("tool_calls")
                calls = []
            ex.engine_messages = ex.engine_messages + [message]
            if not calls:
                break
            outcomes = list(await asyncio.gather(*(self._run_tool(c) for c in calls)))
            ex.engine_messages = ex.engine_messages + tool_messages(calls, outcomes)
            ex.rounds.append(round_summary(index, calls, outcomes))
            if client.head is not None and self._streaming(ex):
                yield b"data: " + orjson.dumps(announcement(client.head, index, calls, outcomes)) + b"\n\n"
            if view.client_calls():
                break  # the client has calls of its own to answer first
            r = await self._next_round(ex)
        if ex.server_tools:
            client.usage = dict(usage, total_tokens=usage["prompt_tokens"] + usage["completion_tokens"])
            if ex.wants_usage and self._streaming(ex) and client.head is not None:
                yield b"data: " + orjson.dumps({**client.head, "object": "chat.completion.chunk", "choices": [],
                                                "usage": client.usage}) + b"\n\n"  # fmt: skip
        await self._close(ex, client)
        yield b"data: [DONE]\n\n"

    def _streaming(self, ex: Exchange) -> bool:
        return bool(ex.body.get("stream"))

    async def _run_tool(self, call: dict[str, Any]) -> Outcome:
        started = time.perf_counter()
        outcome = await self.tools.run(call["function"]["name"], call["function"]["arguments"])
        self.metrics.tool_seconds.labels(call["function"]["name"]).observe(time.perf_counter() - started)
        return outcome

    async def _next_round(self, ex: Exchange) -> Round:
        """The tool results are in: their incremental prefill is the next round's task."""
        created = time.time()
        model = ex.body["model"]
        candidates = {w.info.worker_id for w in self.pool.decoders(model) + self.pool.prefillers(model, exclude="")}
        l_total, signals = await asyncio.gather(
            self._count(model, ex.engine_messages, ex.engine_tools), self._signals(candidates)
        )
        try:  # the decode worker may have been lost while the tools ran: the session moves on
            ex.session, ex.arriving = self._bind(ex.session, ex.scope, None, model, l_total)
        except ValueError as exc:
            raise UpstreamError(f"no decode worker is left for {model}", 503) from exc
        return self.plan(ex, created, l_total, signals)

    async def run_round(self, ex: Exchange, r: Round, reply: Reply, view: ClientView | None) -> AsyncIterator[bytes]:
        """Queue, prefill and decode one round; yields what the client gets of it."""
        times = RoundTimes(queued_at=time.time())
        try:
            estimate = self._estimate(ex.session, r)
            dispatched = await self.queues.submit(r.route.worker_id, r.task, estimate, ex.slo.ttft_s)
        except BaseException as exc:  # refused, or the client left while it was queued
            self._arrived(ex, r)
            if isinstance(exc, QueueFull):
                raise APIError(429, str(exc), code="queue_full") from exc
            raise
        times.queued_s = dispatched.queued_s
        times.dispatched_at = time.time()
        self.metrics.queue_wait.observe(dispatched.queued_s)
        slot_worker: str | None = r.route.worker_id
        request_id = uuid.uuid4().hex
        body = ex.engine_body()
        route_kind, prefill_worker = r.route.kind, r.route.worker_id
        try:
            if r.route.kind == "remote":
                prefill = self.pool.get(prefill_worker)
                try:
                    if prefill is None:
                        raise UpstreamError(f"prefill worker {prefill_worker} left the pool")
                    params = await self.client.prefill(prefill.info.url, body, request_id)
                    times.prefilled_at = time.time()
                    body = dict(body, kv_transfer_params=params)
                except UpstreamError as exc:
                    if 400 <= exc.status < 500:
                        raise
                    log.warning("remote prefill on %s failed (%s); prefilling locally", prefill_worker, exc)
                    if exc.lost:  # no new round goes there until it answers a scrape again
                        self.pool.forget(prefill_worker)
                    self.metrics.routes.labels("local", "fallback").inc()
                    route_kind = "local"
                self.queues.release(prefill_worker, r.task.task_id)
                slot_worker = None
            times.decode_sent_at = time.time()
            async for events in self._decode(ex, r, body, request_id, reply, view):
                yield events
                self._arrived(ex, r)
                if slot_worker is not None:  # the first token is out: the local prefill is over
                    self.queues.release(slot_worker, r.task.task_id)
                    slot_worker = None
            if slot_worker is not None:  # nothing to relay this round (a hidden tool call)
                self.queues.release(slot_worker, r.task.task_id)
                slot_worker = None
            await self._record_round(ex.session, r, reply, route_kind, prefill_worker, times)
        finally:
            self._arrived(ex, r)
            if slot_worker is not None:
                self.queues.release(slot_worker, r.task.task_id)

    def _arrived(self, ex: Exchange, r: Round) -> None:
        """The round reached its decode worker (or ended): its KV shows in that worker's usage."""
        if ex.arriving:
            self.pool.arrived(r.decode.info.worker_id, ex.arriving)
            ex.arriving = 0

    async def _decode(
        self, ex: Exchange, r: Round, body: dict[str, Any], request_id: str, reply: Reply, view: ClientView | None
    ) -> AsyncIterator[bytes]:
        """The round's decode stream; when its worker is lost mid-stream, the stream goes on
        on another decode worker (gateway.migration), up to the migration limit."""
        transform: Transform | None = view
        leg = body
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
                if r.migrations >= self.config.migration_limit:
                    self.metrics.migrations.labels("refused").inc()
                    raise UpstreamError(f"{exc}; not moved: migration limit {self.config.migration_limit}") from exc
                leg, transform = await self._migrate(ex, r, body, reply, view)
                request_id = uuid.uuid4().hex
        if r.migrations and reply.usage is not None:
            reply.usage = round_usage(reply.usage, r.task.l_total)

    async def _migrate(
        self, ex: Exchange, r: Round, body: dict[str, Any], reply: Reply, view: ClientView | None
    ) -> tuple[dict[str, Any], Transform | None]:
        """Re-bind the session off its lost decode worker; the request and chunk rewriter
        that continue the round there."""
        lost, model = r.decode.info.worker_id, ex.body["model"]
        self.pool.forget(lost)
        try:
            session, ex.arriving = self._bind(ex.session, ex.scope, None, model, r.task.l_total)
        except ValueError as exc:
            raise UpstreamError(f"decode worker {lost} was lost and no other is left", 503) from exc
        r.decode, r.migrations = self.pool.workers[session.decode_worker], r.migrations + 1
        leg = continuation_body(body, reply)
        if reply.content:
            url, tools = r.decode.info.url, ex.engine_tools
            prompt = await self.client.tokenize(url, model, leg["messages"], tools, continue_final_message=True)
            leg = with_tokens_left(leg, prompt - r.task.l_total)
        self.metrics.migrations.labels("moved").inc()
        log.warning("session %s: decode worker %s lost mid-stream, continuing on %s", session.session_id, lost,
                    session.decode_worker)  # fmt: skip
        if reply.head is None:  # nothing reached the client: the round simply starts over
            return leg, view
        return leg, Continued(reply.head, r.task.l_total, ex.wants_usage, view)

    async def _record_round(
        self, session: Session, r: Round, reply: Reply, route_kind: str, prefill_worker: str, times: RoundTimes
    ) -> None:
        """After a round: what the decode worker holds, the round's TTFT and ITL in the shared
        statistics, and its record for ``GET /v1/sessions/{id}``."""
        usage = reply.usage or {}
        session.l_hist = int(usage.get("prompt_tokens", r.task.l_total)) + int(usage.get("completion_tokens", 0))
        session.rounds += 1
        if route_kind == "remote":
            session.prefill_worker, session.prefill_cached = prefill_worker, r.task.l_total
        decode_id = r.decode.info.worker_id
        ttft_series = ("ttft", prefill_worker) if route_kind == "remote" else ("ttft_local", decode_id)
        observations = [(*ttft_series, reply.ttft_s or 0.0, 1 if reply.ttft_s is not None else 0)]
        observations.append(("itl", decode_id, sum(reply.itl), len(reply.itl)))
        kind = "incremental" if r.task.incremental else "initial"
        record = {
            "round": session.rounds, "kind": kind, "route": route_kind,
            "prefill_worker": prefill_worker if route_kind == "remote" else None, "decode_worker": decode_id,
            "reason": r.route.reason, "l_hist": r.task.l_hist, "l_incr": r.task.l_incr,
            "queue_wait_s": times.queued_s, "ttft_s": reply.ttft_s, "mean_itl_s": reply.mean_itl_s,
            "completion_tokens": int(usage.get("completion_tokens", 0)), "started_at": r.task.created_at,
            "migrations": r.migrations,
        }  # fmt: skip
        self._trace_round(session, r, reply, route_kind, prefill_worker, times)
        async with self.redis.pipeline(transaction=False) as pipe:
            self.stats.record(pipe, observations)
            self.sessions.record_round(pipe, session, record)
            await self._write(pipe, "round record")
        if reply.ttft_s is not None:
            self.metrics.ttft.labels(kind).observe(reply.ttft_s)
        if reply.mean_itl_s is not None:
            self.metrics.itl.observe(reply.mean_itl_s)

    def _trace_round(
        self, session: Session, r: Round, reply: Reply, route_kind: str, prefill_worker: str, times: RoundTimes
    ) -> None:
        """The round's spans (gateway.tracing), under the session's span."""
        end = reply.last_token_at or time.time()
        first = reply.first_token_at or end
        if not session.trace_id:
            started = session.created or r.task.created_at
            session.trace_id, session.span_id = self.tracer.session(session.session_id, session.scope, started, end)
        task, decode_id = r.task, r.decode.info.worker_id
        worker = prefill_worker if route_kind == "remote" else decode_id
        prefill = {"ampd.route": route_kind, "ampd.worker": worker, "ampd.l_hist": task.l_hist,
                   "ampd.l_incr": task.l_incr}  # fmt: skip
        phases = [("queue_wait", times.queued_at, times.dispatched_at, {"ampd.worker": r.route.worker_id})]
        if route_kind == "remote" and times.prefilled_at is not None:
            phases.append(("prefill", times.dispatched_at, times.prefilled_at, prefill))
            phases.append(("kv_transfer", times.decode_sent_at, first, {"ampd.from": worker, "ampd.to": decode_id}))
        else:
            phases.append(("prefill", times.decode_sent_at, first, prefill))
        tokens = int((reply.usage or {}).get("completion_tokens", 0))
        decode = {"ampd.worker": decode_id, "ampd.tokens": tokens, "ampd.ttft_s": reply.ttft_s or 0.0,
                  "ampd.itl_mean_s": reply.mean_itl_s or 0.0, "ampd.itl_p95_s": reply.p95_itl_s or 0.0}  # fmt: skip
        phases.append(("decode", first, end, decode))
        attributes = {"ampd.session.id": session.session_id, "ampd.round": session.rounds,
                      "ampd.kind": "incremental" if task.incremental else "initial", "ampd.route": route_kind,
                      "ampd.reason": r.route.reason}  # fmt: skip
        self.tracer.round((session.trace_id, session.span_id), task.created_at, end, attributes, phases)

    async def _close(self, ex: Exchange, client: Reply) -> None:
        """Remember the exchange: the conversation the client now holds, and - when it
        differs - what the engine holds, for the session's next request."""
        conversation = ex.client_messages + [client.message()]
        if self.config.log_content:
            asked, answered = orjson.dumps(ex.client_messages).decode(), orjson.dumps(client.message()).decode()
            content_log.info("session %s: %s -> %s", ex.session.session_id, asked, answered)
        transcript = ex.engine_messages if ex.engine_messages != conversation else None
        async with self.redis.pipeline(transaction=False) as pipe:
            self.sessions.save(pipe, ex.session, conversation, transcript)
            await self._write(pipe, "session")

    async def _write(self, pipe: aioredis.client.Pipeline, what: str) -> None:
        """Shared state written after a round; lost, not fatal, while Redis is away."""
        try:
            await pipe.execute()
        except REDIS_DOWN as exc:
            self.health.failed(what, exc)


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="ampd gateway", lifespan=lifespan)
    app.state.gateway = gateway
    app.openapi = lambda: _document(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        gateway.metrics.requests.labels(str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(aioredis.RedisError)
    async def redis_error(request: Request, exc: aioredis.RedisError) -> JSONResponse:
        """What cannot go on without Redis (a session's records, say) says so (gateway.outage)."""
        gateway.health.failed("request", exc)
        return await api_error(request, APIError(503, f"shared state unavailable: {exc}", code="redis_unavailable"))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Ready while a decode worker is known. Without Redis the replica still serves
        (gateway.outage), so it stays in rotation and says it is degraded."""
        problems = []
        try:
            await gateway.redis.ping()
        except REDIS_DOWN as exc:
            problems.append(f"redis: {exc}")
        serving = any(w.info.decodes for w in gateway.pool.workers.values())
        if not serving:
            problems.append("no decode worker")
        status = "not ready" if not serving else "degraded" if problems else "ready"
        body = {"status": status, "problems": problems, "workers": sorted(gateway.pool.workers)}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(aioredis.RedisError, OSError):  # a Redis outage must not hide the rest
            gateway.metrics.sessions_active.set(await gateway.sessions.active())
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.authenticate(request.headers.get("authorization"))
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "ampd"} for m in gateway.pool.models()]
        return {"object": "list", "data": data}

    @app.get("/v1/sessions/{session_id}")
    async def session_rounds(session_id: str, request: Request) -> dict[str, Any]:
        """Every round of a session: route, queue wait, TTFT, ITL. Scoped to the caller's key,
        so another tenant's session id is simply not found."""
        scope = gateway.authenticate(request.headers.get("authorization"))
        session = await gateway.sessions.load(scope, session_id)
        if session is None:
            raise APIError(404, f"No session found with id '{session_id}'.", code="session_not_found")
        return {
            "id": session_id, "object": "session", "created": int(session.created),
            "decode_worker": session.decode_worker, "rounds": await gateway.sessions.rounds(scope, session_id),
        }  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        scope = gateway.authenticate(request.headers.get("authorization"))
        raw = await _read_json(request, config.max_body_bytes)
        try:
            ex, first_round = await gateway.open(raw, dict(request.headers), scope)
        except UpstreamError as exc:  # counting the prompt failed: no worker to blame the client for
            raise _upstream_api_error(exc) from exc
        client = Reply(started=ex.arrival)
        events = gateway.converse(ex, first_round, client)
        try:
            first = await anext(events)  # errors up to the first token still get a status code
        except UpstreamError as exc:
            raise _upstream_api_error(exc) from exc
        route = first_round.route  # as decided; the decode worker as it is now (a lost one is replaced)
        headers = {"X-Session-Id": ex.session.session_id, "X-AMPD-Route": f"{route.kind}:{route.worker_id}",
                   "X-AMPD-Decode-Worker": first_round.decode.info.worker_id}  # fmt: skip
        if raw.get("stream"):
            gateway.metrics.requests.labels("200").inc()
            return StreamingResponse(_relay(first, events), media_type="text/event-stream", headers=headers)
        async for _ in _safe(events):
            pass
        gateway.metrics.requests.labels("200").inc()
        body = client.completion()
        if ex.rounds:
            body["ampd_tool_rounds"] = ex.rounds
        return JSONResponse(body, headers=headers)

    return app


def _document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI document plus the chat request's body, which FastAPI cannot see:
    the route reads its body itself, for the size limit and OpenAI-shaped errors."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        body = ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(body.pop("$defs", {}), ChatRequest=body)
        content = {"application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}
        document["paths"]["/v1/chat/completions"]["post"]["requestBody"] = {"required": True, "content": content}
        app.openapi_schema = document
    return app.openapi_schema


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


async def _relay(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    try:
        async for event in rest:
            yield event
    except (UpstreamError, APIError) as exc:  # the status line is gone: report in-band, as vLLM does
        error = _upstream_api_error(exc) if isinstance(exc, UpstreamError) else exc
        yield f"data: {json.dumps(error.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"


async def _safe(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    except UpstreamError as exc:
        raise _upstream_api_error(exc) from exc


def _upstream_api_error(exc: UpstreamError) -> APIError:
    error = (exc.body or {}).get("error") if isinstance(exc.body, dict) else None
    if error and 400 <= exc.status < 500:  # the engine refused the request itself: pass it on
        return APIError(exc.status, error.get("message", str(exc)), error.get("param"))
    return APIError(502, f"upstream failure: {exc}", code="upstream_error")
