"""The coordinator: one client request (an exchange) from its body to its last round.

The life of an exchange: read its session and the load signals of the workers it could
use in one round trip (gateway.state.round_reads) while its prompt is counted (in the gateway
with its model's tokenizer and template where it has them, gateway.engines.tokens, else with
the engine's ``/tokenize``), and bind the session to a decode worker; plan its first round with the
round core and run it (gateway.rounds); when server-side tools are enabled, run the calls
the model made on the tools workers and the next round after them (gateway.tool_loop);
finally remember the conversation the client now holds, and what the engine holds when
that differs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import redis.asyncio as aioredis
from pydantic import ValidationError

from gateway.apis.schema import APIError, ChatRequest, check_tool_messages, validation_error
from gateway.config import GatewayConfig
from gateway.elastic_live import ElasticLoop
from gateway.engines.kv_index import cached_tokens
from gateway.engines.kv_subscriber import KVSubscriber
from gateway.engines.model_tokenizer import Counted
from gateway.engines.pool import WorkerPool
from gateway.engines.step_targets import StepTargets
from gateway.engines.tokens import ServedTokenizers
from gateway.engines.upstream import EngineClient, Reply, UpstreamError
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.rounds import Round, RoundRunner
from gateway.state.failover import Failover
from gateway.state.outage import RedisHealth
from gateway.state.prefill_queue import PrefillQueues
from gateway.state.redis_batch import RedisBatch
from gateway.state.round_ledger import foreign as foreign_requests
from gateway.state.round_reads import RoundReads
from gateway.state.sessions import SessionStore, continues, conversation_hashes, explicit_session_id, new_session
from gateway.tenancy import KEYS_POLL_S, Keyring
from gateway.tool_loop import ClientView, announcement, round_summary, tool_messages
from perfmodel.slo import SLO
from rounds.core import Bound, Signals
from tools_sandbox.client import ToolRunner
from tools_sandbox.outcome import Outcome
from tools_sandbox.registry import TOOLS, openai_tool

log = logging.getLogger(__name__)
content_log = logging.getLogger("ampd.content")  # prompts and replies: only with config.log_content


@dataclass
class Gateway:
    """One gateway replica's coordinator: what it holds (wired by gateway.assemble), and
    an exchange's life from its body to its last round."""

    config: GatewayConfig
    redis: aioredis.Redis
    batch: RedisBatch
    client: EngineClient
    metrics: GatewayMetrics
    health: RedisHealth
    pool: WorkerPool
    queues: PrefillQueues
    sessions: SessionStore
    reads: RoundReads
    tokenizers: ServedTokenizers
    rounds: RoundRunner
    tools: ToolRunner
    step_targets: StepTargets
    keys: Keyring
    kv: KVSubscriber
    failover: Failover
    elastic: ElasticLoop | None = None
    # Requests each engine's last scrape showed that no replica sent (gateway.state.round_ledger).
    foreign: dict[str, int] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self._refresh()
        await self.queues.start()
        self._tasks = [asyncio.create_task(self._refresh_forever(), name="pool-refresh")]
        if self.keys.file is not None:
            self._tasks.append(asyncio.create_task(self.keys.watch(KEYS_POLL_S), name="keys-file"))
        if self.elastic is not None:
            self._tasks.append(asyncio.create_task(self.elastic.run_forever(self.slo_for), name="elastic"))
        if self.failover.managed:
            self._tasks.append(asyncio.create_task(self.failover.follow_forever(), name="redis-primary"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.kv.close()
        await self.queues.stop()
        await self.client.close()
        self.tools.close()
        await self.batch.close()
        await self.redis.aclose()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.scrape_interval_s)
            try:
                await self._refresh()
            except Exception:  # the next refresh tries again; a dead loop would freeze the pool unseen
                log.exception("pool refresh failed")

    async def _refresh(self) -> None:
        ledger = self.queues.ledger
        before = await ledger.counts(list(self.pool.workers))
        await self.pool.refresh()
        if ledger.enabled:  # only a placement by the engines' caches reads load in requests
            after = await ledger.counts(list(self.pool.workers))
            scraped = {w: live.load.running + live.load.waiting for w, live in self.pool.workers.items()}
            self.foreign = foreign_requests(scraped, before, after)
        self.queues.watch(self.pool.workers)
        self.tokenizers.prepare(self.pool.models())
        await self.step_targets.assign(w.info for w in self.pool.workers.values())
        if self.config.kv_index:
            workers = self.pool.workers.values()
            self.kv.follow((w.info for w in workers), busy={w.info.worker_id for w in workers if w.load.running})

    # -- an exchange begins -----------------------------------------------------------------
    def authenticate(self, authorization: str | None, api_key: str | None = None) -> str:
        """The caller's scope: sessions, hashes and ids are namespaced by it. The key is
        ``Authorization: Bearer <key>``, else ``api_key`` (Anthropic's ``x-api-key`` header)."""
        key = (authorization or "").removeprefix("Bearer ").strip() or (api_key or "").strip()
        scope = self.keys.scope(key)
        if scope is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return scope

    def slo_for(self, model: str) -> SLO:
        worker = self.pool.decoders(model)[0].info
        return self.config.slo(worker.profile, worker.speed)

    def resolve_model(self, requested: str | None) -> str:
        """The model the engines serve that ``requested`` names: their own name for it, or
        one of the gateway's served model names, which stand for the one model they serve."""
        models = self.pool.models()
        if requested in self.config.served_model_names:
            if len(models) > 1:
                raise APIError(503, f"the served model name {requested!r} stands for one model, and the engines "
                               f"serve {len(models)}: {', '.join(models)}", code="ambiguous_model")  # fmt: skip
            requested = models[0] if models else requested
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

    async def open(
        self, raw: dict[str, Any], headers: dict[str, str], scope: str, session_id: str | None = None
    ) -> tuple[Exchange, Round]:
        """Everything before the first prefill runs: session, binding, counting, the plan.
        ``session_id``: the session the API's own state names (a Responses request's
        ``previous_response_id``), taken before any the client gave."""
        arrival = time.time()
        request, model, server_tools, engine_tools, messages = self._read(raw)
        hashes = conversation_hashes(scope, messages)
        explicit = session_id or explicit_session_id(headers, raw)
        # One concurrent stage: the prompt's length, and in one Redis round trip the session
        # and the load signals of every worker the round could go to (which one it is
        # depends on the first two).
        ids = self.config.kv_index
        opened, counted = await asyncio.gather(
            self.reads.read(scope, explicit, hashes, self._candidates(model)),
            self._count(model, messages, engine_tools or None, ids),
        )
        session, transcript, signals = opened.session, opened.transcript, opened.signals
        extends = session is not None and continues(session, hashes)
        engine_messages = messages
        if extends and transcript is not None:  # server tool rounds the client never saw
            engine_messages = transcript + messages[session.conversation_len :]
            counted = await self._count(model, engine_messages, engine_tools or None, ids)
        l_total = counted.tokens
        signals = self._placement_signals(model, counted, raw.get("cache_salt"), signals)
        bound = self.rounds.bind(session.state if session else None, model, l_total, extends, signals)
        if session is None:
            self.metrics.sessions.inc()
            session = new_session(
                explicit or secrets.token_hex(16), scope, bound.state, explicit_id=explicit is not None
            )
        wants_usage = bool(request.stream_options and request.stream_options.include_usage) or not request.stream
        exchange = Exchange(
            arrival, scope, dict(raw, model=model), messages, engine_messages, engine_tools or None,
            server_tools, session, self.slo_for(model), wants_usage, request_hash=hashes[-1] if hashes else "",
        )  # fmt: skip
        exchange.rebound(bound)
        return exchange, self._plan(exchange, bound, l_total, arrival, signals)

    async def count(self, raw: dict[str, Any]) -> int:
        """The prompt tokens of a chat body as its first round would count them (its
        server tools included), without running it: Anthropic's ``count_tokens``."""
        _, model, _, tools, messages = self._read(raw)
        return (await self._count(model, messages, tools or None)).tokens

    def _read(self, raw: dict[str, Any]) -> tuple[ChatRequest, str, frozenset[str], list[dict[str, Any]], list]:
        """A chat body checked as a round reads it: the request, its model, the server tools
        it enables, the tools the engine is offered (the client's and those) and its messages."""
        try:
            request = ChatRequest.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        check_tool_messages(request.messages)
        model = self.resolve_model(request.model)
        server_tools = self._enabled_tools(request)
        engine_tools = (raw.get("tools") or []) + [openai_tool(TOOLS[name]) for name in sorted(server_tools)]
        messages = request.model_dump(include={"messages"}, exclude_none=True)["messages"]  # one call: half the cost
        return request, model, server_tools, engine_tools, messages

    def _enabled_tools(self, request: ChatRequest) -> frozenset[str]:
        wanted = frozenset(request.server_tools or ())
        unknown = wanted - set(self.config.server_tools)
        if unknown:
            raise APIError(400, f"server_tools not offered by this gateway: {sorted(unknown)}", param="server_tools")
        clashing = wanted & {t.function.name for t in request.tools or []}
        if clashing:
            raise APIError(400, f"tools named like server tools: {sorted(clashing)}", param="tools")
        return wanted

    async def _count(
        self, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, ids: bool = False
    ) -> Counted:
        """The prompt's length in tokens, and its token ids where ``ids`` and the gateway can
        make them: counted here with its model's tokenizer and template where the gateway
        has them (gateway.engines.tokens), else by the least loaded decode worker (no ids).
        One that is lost (killed since its last scrape) is left out of the pool and the
        next one asked."""
        lost: UpstreamError | None = None
        for worker in sorted(self.pool.decoders(model), key=lambda w: w.load.kv_usage):
            counted = self.tokenizers.count(model, worker.info.url, messages, tools, ids)
            if counted is not None:  # else the engine is asked (where it refuses the prompt, its error is the client's)
                return counted
            try:
                return Counted(await self.client.tokenize(worker.info.url, model, messages, tools))
            except UpstreamError as exc:
                if not exc.lost:
                    raise
                self.pool.forget(worker.info.worker_id)
                lost = exc
        raise lost or UpstreamError(f"no decode worker is available for {model}", 503)

    def _plan(self, ex: Exchange, bound: Bound, l_total: int, created: float, signals: Signals) -> Round:
        """The round's plan; its record keeps what the KV index saw of the prompt."""
        r = self.rounds.plan(ex, bound, l_total, created, signals)
        r.indexed = dict(signals.cached_tokens) or None
        return r

    def _placement_signals(self, model: str, counted: Counted, cache_salt: str | None, signals: Signals) -> Signals:
        """Under a placement by the engines' caches (rounds.placement), the signals the core
        binds and routes by gain what each engine holds of the prompt, as the KV index sees
        it, and the requests its last scrape showed that no replica sent (the round ledger
        counts the rest exactly: gateway.state.round_ledger). Under ``memory`` no ids are
        made (``_count``) and nothing is hashed, so the hot path pays nothing."""
        if counted.ids is None:  # memory, or no ids for the model: placement falls back to memory
            return signals
        workers = self._candidates(model)
        hashing = self.kv.hashing(workers)
        if not hashing:  # no engine indexed
            return signals
        unwritten = self.queues.ledger.unwritten()
        return replace(
            signals, cached_tokens=cached_tokens(self.kv.index, hashing, counted.ids, cache_salt),
            running={w: n + unwritten[w] + self.foreign.get(w, 0) for w, n in signals.running.items()},
        )  # fmt: skip

    def _candidates(self, model: str) -> list[str]:
        """Every worker a round of ``model`` could use."""
        return sorted({w.info.worker_id for w in self.pool.decoders(model) + self.pool.prefillers(model, exclude="")})

    # -- its rounds -------------------------------------------------------------------------
    async def converse(self, ex: Exchange, first: Round, client: Reply) -> AsyncIterator[bytes]:
        """Run the exchange's rounds; yields the SSE events the client gets and fills
        ``client`` (what a non-streaming client gets). Without server-side tools this
        is one round relayed as it is; with them, every round whose calls are all
        server-side is followed by the tools and another round (gateway.tool_loop)."""
        r, usage, limit = first, {"prompt_tokens": 0, "completion_tokens": 0}, self.config.max_tool_rounds
        for index in range(1, limit + 2):
            engine = Reply(started=r.plan.task.created_at) if ex.server_tools else client
            view = ClientView(ex.server_tools, engine, client, index > limit)
            r.index = index
            async for events in self.rounds.run(ex, r, engine, view if ex.server_tools else None):
                yield events
            if ex.server_tools:  # more rounds or events may follow: the record goes now
                await self.rounds.recorder.flush(ex)
            for key in usage:
                usage[key] += int((engine.usage or {}).get(key, 0))
            calls = view.server_calls() if ex.server_tools else []
            message = engine.message()
            if calls and index > limit:  # out of rounds: the calls go unanswered
                message.pop("tool_calls")
                calls = []
            ex.engine_messages = ex.engine_messages + [message]
            if not calls:
                break
            outcomes = list(await asyncio.gather(*(self._run_tool(c) for c in calls)))
            ex.engine_messages = ex.engine_messages + tool_messages(calls, outcomes)
            ex.rounds.append(round_summary(index, calls, outcomes))
            if client.head is not None and ex.streaming:
                yield b"data: " + orjson.dumps(announcement(client.head, index, calls, outcomes)) + b"\n\n"
            if view.client_calls():
                break  # the client has calls of its own to answer first
            r = await self._next_round(ex)
        if ex.server_tools:
            client.usage = dict(usage, total_tokens=usage["prompt_tokens"] + usage["completion_tokens"])
            if ex.wants_usage and ex.streaming and client.head is not None:
                yield b"data: " + orjson.dumps({**client.head, "object": "chat.completion.chunk", "choices": [],
                                                "usage": client.usage}) + b"\n\n"  # fmt: skip
        await self._close(ex, client)
        yield b"data: [DONE]\n\n"

    async def _run_tool(self, call: dict[str, Any]) -> Outcome:
        started = time.perf_counter()
        outcome = await self.tools.run(call["function"]["name"], call["function"]["arguments"])
        self.metrics.tool_seconds.labels(call["function"]["name"]).observe(time.perf_counter() - started)
        return outcome

    async def _next_round(self, ex: Exchange) -> Round:
        """The tool results are in: their incremental prefill is the next round's task."""
        created, model = time.time(), ex.body["model"]
        counted, signals = await asyncio.gather(
            self._count(model, ex.engine_messages, ex.engine_tools, self.config.kv_index),
            self.reads.signals(self._candidates(model)),
        )
        l_total = counted.tokens
        signals = self._placement_signals(model, counted, ex.body.get("cache_salt"), signals)
        try:  # the decode worker may have been lost while the tools ran: the session moves on
            bound = self.rounds.bind(ex.session.state, model, l_total, signals=signals)
        except ValueError as exc:
            raise UpstreamError(f"no decode worker is left for {model}", 503) from exc
        ex.rebound(bound)
        return self._plan(ex, bound, l_total, created, signals)

    # -- the exchange ends ------------------------------------------------------------------
    async def _close(self, ex: Exchange, client: Reply) -> None:
        """Remember the exchange: the conversation the client now holds, and - when it
        differs - what the engine holds, for the session's next request."""
        reply = client.message()
        conversation = ex.client_messages + [reply]
        if self.config.log_content:
            asked, answered = orjson.dumps(ex.client_messages).decode(), orjson.dumps(reply).decode()
            content_log.info("session %s: %s -> %s", ex.session.session_id, asked, answered)
        transcript = ex.engine_messages if ex.engine_messages != conversation else None
        # With the round's record, where it is still staged: one round trip closes the exchange.
        if ex.writes is None:
            ex.writes = self.redis.pipeline(transaction=False)
        digest = conversation_hashes(ex.scope, [reply], after=ex.request_hash)[-1]
        self.sessions.save(ex.writes, ex.session, conversation, digest, transcript)
        await self.rounds.recorder.flush(ex, "session")
