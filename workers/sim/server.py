"""The GPU-free engine's HTTP server: vLLM's OpenAI surface over the simulated core.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /tokenize``, ``GET /health`` (and ``/ping``), ``GET /version``, ``GET /metrics``,
plus the KV side channel (workers.sim.kv_transfer). Disaggregation follows vLLM's
NixlConnector protocol through ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from perfmodel.profile import Profile
from rounds.engine.kv_cache import salt_hash
from rounds.engine.request import RemotePrefill
from rounds.engine.request import Request as EngineRequest
from rounds.engine.scheduler import Scheduler, SchedulerConfig
from surface.registry import Registration, Role, WorkerInfo, heartbeat_client, publish_tokenizer
from surface.wire import PULL_FIELDS, SPLIT_AT, pull_params
from workers.sim import protocol as p
from workers.sim.engine import AsyncEngine, RequestStream, StreamEvent
from workers.sim.kv_transfer import KVSideChannel
from workers.sim.metrics import EngineMetrics
from workers.sim.responder import Length, Reply, Responder, ScriptError
from workers.sim.tokenizer import BOS, Tokenizer, render_chat
from workers.sim.tokenizer import files as tokenizer_files

# vLLM bounds characters per token by its vocabulary's longest token; the sim's pieces
# are words of any length, so it takes a bound real text stays far below.
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class WorkerConfig:
    profile: Profile
    role: Role = "both"
    port: int = 8100
    advertise_host: str = "127.0.0.1"  # where peers reach this worker's side channel
    served_model_name: str | None = None
    max_model_len: int | None = None
    speed: float = 1.0
    scheduler: SchedulerConfig = SchedulerConfig()
    default_output_tokens: int = 32
    enable_prompt_tokens_details: bool = False
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    redis_url: str | None = None  # register in this Redis and heartbeat (surface.registry)
    redis_prefix: str = "ampd"

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.profile.model.hf_id


class SimWorker:
    """Everything one engine process holds; the app reads it through ``worker()``."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config.profile, config.scheduler)
        capacity = self.scheduler.kv.num_blocks * self.scheduler.kv.block_size
        self.max_model_len = config.max_model_len or config.profile.model.max_model_len
        if capacity < self.max_model_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the KV cache ({capacity} tokens); "
                "lower --max-model-len or give the cache more blocks"
            )
        self.tokenizer = Tokenizer(config.profile.model.vocab_size)
        self.responder = Responder(self.tokenizer, config.default_output_tokens)
        self.metrics = EngineMetrics(self.scheduler, config.model_name, self.max_model_len)
        self.side_channel = KVSideChannel()
        self.engine = AsyncEngine(
            self.scheduler,
            self.metrics,
            self.side_channel,
            speed=config.speed,
            kv_load_failure_policy=config.kv_load_failure_policy,
        )

    def check_model(self, model: str | None) -> None:
        if model and model != self.config.model_name:
            raise p.EngineError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.config.model_name}.",
                "NotFoundError",
                "model",
            )

    def encode_prompt(self, text: str) -> list[int]:
        """vLLM 0.32's check before tokenizing (vllm/renderers/params.py): a prompt longer
        in characters than max_model_len tokens could ever hold is refused unread."""
        limit, chars = self.max_model_len, self.max_model_len * MAX_CHARS_PER_TOKEN
        if len(text) > chars:
            raise p.EngineError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(text)} characters (more than {chars} characters, which is the upper bound for {limit} "
                f"input tokens). Please reduce the length of the input prompt. "
                f"(parameter=input_text, value={len(text)})",
                param="input_text",
            )
        return self.tokenizer.encode(text)

    def max_tokens_for(self, prompt_len: int, requested: int | None, param: str) -> int:
        """vLLM's length rules: reject an over-long prompt, clamp max_tokens to the context.
        vLLM stops tokenizing one token past the limit, hence "at least"."""
        limit = self.max_model_len
        if prompt_len > limit:
            raise p.EngineError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"at least {limit + 1} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={limit + 1})",
                param="input_tokens",
            )
        if requested is not None and requested > limit:
            raise p.EngineError(
                400,
                f"{param}={requested} cannot be greater than max_model_len={limit}. Please request fewer "
                f"output tokens. (parameter={param}, value={requested})",
                param=param,
            )
        room = limit - prompt_len
        if room < 1:
            raise p.EngineError(400, f"{param} must be at least 1, got 0. (parameter={param}, value=0)", param=param)
        return room if requested is None else min(requested, room)

    def transfer_role(self, params: dict[str, Any] | None) -> tuple[bool, RemotePrefill | None]:
        """Read vLLM's ``kv_transfer_params``: (prefill-only?, where to pull KV from)."""
        if not params:
            return False, None
        role = self.config.role
        if params.get("do_remote_decode"):
            if role == "decode":
                raise p.EngineError(400, "this worker is a decode worker (kv_consumer); it does not produce KV")
            return True, None
        if not params.get("do_remote_prefill"):
            return False, None
        if role == "prefill":
            raise p.EngineError(400, "this worker is a prefill worker (kv_producer); it does not pull KV")
        missing = [k for k in PULL_FIELDS if params.get(k) in (None, "")]
        if missing:
            raise p.EngineError(400, f"kv_transfer_params lacks {', '.join(missing)}", param="kv_transfer_params")
        block_ids = params["remote_block_ids"]
        if block_ids and isinstance(block_ids[0], list):  # one list per KV-cache group (vLLM >= 0.12)
            if len(block_ids) != 1:
                raise p.EngineError(400, "only one KV-cache group is supported", param="kv_transfer_params")
            block_ids = block_ids[0]
        num_tokens = params.get("remote_num_tokens")
        return False, RemotePrefill(
            engine_id=str(params["remote_engine_id"]),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            request_id=str(params["remote_request_id"]),
            block_ids=tuple(int(b) for b in block_ids),
            num_tokens=None if num_tokens is None else int(num_tokens),
        )

    def split_prompt(self, params: dict[str, Any] | None, prompt_ids: list[int]) -> list[int]:
        """The prompt a prefill-only request computes: the whole, or its first ``split_at``
        tokens (surface.wire.SPLIT_AT) - whole blocks, as the decode engine pulls them."""
        if not params or not params.get("do_remote_decode") or params.get(SPLIT_AT) is None:
            return prompt_ids
        split_at, block = params[SPLIT_AT], self.config.scheduler.block_size
        if not isinstance(split_at, int) or isinstance(split_at, bool) or split_at < 1 or split_at % block:
            raise p.EngineError(
                400, f"{SPLIT_AT} must be a positive multiple of the KV block size ({block}), got {split_at!r}",
                param="kv_transfer_params",
            )  # fmt: skip
        return prompt_ids[:split_at]

    def kv_params_out(self, request: EngineRequest, held: tuple[int, ...]) -> dict[str, Any] | None:
        if not held:
            return None
        c = self.config
        # As vLLM's connector: the tokens whose KV the blocks hold - the prompt, and a request allowed
        # more than one token also its output but the last (a hand-off mid-decode, DynaServe's alpha).
        return pull_params(c.engine_id, request.request_id, c.advertise_host, c.port, list(held),
                           request.num_computed_tokens, c.profile.tp)  # fmt: skip

    def usage(self, stream: RequestStream, completion_tokens: int) -> p.Usage:
        request = stream.request
        cached = None
        if self.config.enable_prompt_tokens_details:
            cached = request.num_cached_tokens + stream.pulled_tokens
        return p.Usage(request.num_prompt_tokens, completion_tokens, cached)


def worker(request: Request) -> SimWorker:
    return request.app.state.worker


WorkerDep = Annotated[SimWorker, Depends(worker)]


def create_app(config: WorkerConfig) -> FastAPI:
    state = SimWorker(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        # What exists now (the KV cache's per-block lists, the tokenizer, the app) lives as long
        # as the process: frozen out of the collector's sight, as vLLM's server freezes its heap
        # once started (vllm.utils.gc_utils.freeze_gc_heap), and before the engine registers, so
        # no request waits for the collection. Unfrozen, each full collection walked it and
        # stalled every stream on the engine (README, Load).
        gc.collect()
        gc.freeze()
        async with _registered(state):
            yield
        await state.engine.stop()
        await state.side_channel.close()

    app = FastAPI(title="ampd GPU-free engine", lifespan=lifespan)
    app.state.worker = state

    @app.exception_handler(p.EngineError)
    async def engine_error(_: Request, exc: p.EngineError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc.errors()), status_code=400)

    @app.get("/health")
    @app.get("/ping")
    async def health(w: WorkerDep) -> Response:
        return Response(status_code=200 if w.engine.alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": p.SYSTEM_FINGERPRINT_PREFIX}

    @app.get("/v1/models")
    async def models(w: WorkerDep) -> dict[str, Any]:
        created = int(asyncio.get_running_loop().time())
        name = w.config.model_name
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": name,
                    "parent": None,
                    "max_model_len": w.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{secrets.token_hex(8)}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }

    @app.get("/metrics")
    async def metrics(w: WorkerDep) -> Response:
        return Response(generate_latest(w.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request, w: WorkerDep) -> dict[str, Any]:
        body = await _json_body(request)
        if "messages" in body:
            chat = _parse(p.TokenizeChatRequest, body)
            w.check_model(chat.model)
            text = _render(p.message_dicts(chat.messages), _tools(chat.tools), chat)
        else:
            plain = _parse(p.TokenizeCompletionRequest, body)
            w.check_model(plain.model)
            text = (BOS if plain.add_special_tokens else "") + plain.prompt
            chat = plain
        pieces = w.tokenizer.pieces(text)
        return {
            "count": len(pieces),
            "max_model_len": w.max_model_len,
            "tokens": [w.tokenizer.piece_id(x) for x in pieces],
            "token_strs": pieces if chat.return_token_strs else None,
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request, w: WorkerDep):
        w.check_model(body.model)
        _reject_unsupported(body.n, body.logprobs)
        messages, tools = p.message_dicts(body.messages), _tools(body.tools)
        prompt_ids = w.encode_prompt(_render(messages, tools, body))
        requested, param = body.requested_max_tokens
        length = _length(body, w.max_tokens_for(len(prompt_ids), requested, param))
        try:
            reply = w.responder.chat(
                messages,
                tools,
                body.effective_tool_choice,
                body.parallel_tool_calls,
                body.sim_script,
                body.seed,
                length,
                body.continue_final_message,
            )
        except ScriptError as exc:
            raise p.EngineError(400, str(exc), param="sim_script") from exc
        ids = p.ResponseIds(f"chatcmpl-{_request_id(request)}", w.config.model_name, "chat.completion.chunk")
        stream = _submit(w, ids, prompt_ids, reply, length, body)
        if body.stream:
            return _sse(_chat_stream(w, body, ids, stream, reply), w, stream)
        outcome = await _run_to_end(w, stream, request)
        if isinstance(outcome, Response):
            return outcome
        n, final = outcome
        done = reply.prefix(n)
        tool_choice, parses = body.effective_tool_choice, body.parses_tools
        message = p.chat_message(done, done.text, tool_choice, parses)
        finish = p.chat_finish_reason(final.finish_reason or "stop", done, tool_choice, parses, stream=False)
        stop_reason = done.stop_reason if final.finish_reason == "stop" else None
        kv_out = w.kv_params_out(stream.request, final.held_block_ids)
        return JSONResponse(p.chat_response(ids, message, finish, stop_reason, w.usage(stream, n), kv_out))

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request, w: WorkerDep):
        w.check_model(body.model)
        _reject_unsupported(body.n, bool(body.logprobs))
        prompt_text, prompt_ids = _completion_prompt(w, body)
        length = _length(body, w.max_tokens_for(len(prompt_ids), body.max_tokens, "max_tokens"))
        reply = w.responder.completion(body.sim_script, body.seed, length)
        ids = p.ResponseIds(f"cmpl-{_request_id(request)}", w.config.model_name, "text_completion")
        stream = _submit(w, ids, prompt_ids, reply, length, body)
        echo = prompt_text if body.echo else ""
        if body.stream:
            return _sse(_completion_stream(w, body, ids, stream, reply, echo), w, stream)
        outcome = await _run_to_end(w, stream, request)
        if isinstance(outcome, Response):
            return outcome
        n, final = outcome
        done = reply.prefix(n)
        stop_reason = done.stop_reason if final.finish_reason == "stop" else None
        kv_out = w.kv_params_out(stream.request, final.held_block_ids)
        body_out = p.completion_response(
            ids, echo + done.text, final.finish_reason or "stop", stop_reason, w.usage(stream, n), kv_out
        )
        return JSONResponse(body_out)

    @app.get("/kv/handshake")
    async def kv_handshake(w: WorkerDep) -> dict[str, Any]:
        return {
            "engine_id": w.config.engine_id,
            "block_size": w.scheduler.kv.block_size,
            "profile": w.config.profile.model_dump(mode="json"),
        }

    @app.post("/kv/read")
    async def kv_read(read: KVRead, w: WorkerDep) -> dict[str, Any]:
        blocks = w.scheduler.read_held(read.request_id, read.block_ids)
        if blocks is None:
            raise p.EngineError(404, f"no KV held for {read.request_id} with those blocks", "NotFoundError")
        w.engine.release_transfer(read.request_id)
        return {"blocks": blocks}

    return app


@contextlib.asynccontextmanager
async def _registered(w: SimWorker) -> AsyncIterator[None]:
    """Heartbeat into the worker registry while serving, if a Redis is configured, its
    tokenizer and chat template published first, as vLLM's supervisor publishes a model's."""
    config = w.config
    if config.redis_url is None:
        yield
        return
    redis = heartbeat_client(config.redis_url)
    info = WorkerInfo(
        worker_id=f"sim-{config.role}-{config.advertise_host}:{config.port}",
        role=config.role,
        url=config.url,
        model=config.model_name,
        profile=config.profile,
        speed=config.speed,
        kv_capacity_tokens=w.scheduler.kv.num_blocks * w.scheduler.kv.block_size,
        prefill_chunk=config.scheduler.long_prefill_token_threshold,
        splits=True,
    )
    await publish_tokenizer(redis, config.redis_prefix, config.model_name, tokenizer_files())
    beat = asyncio.create_task(Registration(redis, config.redis_prefix, info).run())
    try:
        yield
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await redis.aclose()


class KVRead(BaseModel):
    request_id: str
    block_ids: list[int]


# -- helpers -------------------------------------------------------------------------


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or secrets.token_hex(8)


def _submit(
    w: SimWorker,
    ids: p.ResponseIds,
    prompt_ids: list[int],
    reply: Reply,
    length: Length,
    body: p.ChatCompletionRequest | p.CompletionRequest,
) -> RequestStream:
    prefill_only, remote = w.transfer_role(body.kv_transfer_params)
    request = EngineRequest(
        request_id=f"{ids.id}-{secrets.token_hex(4)}",
        prompt_token_ids=w.split_prompt(body.kv_transfer_params, prompt_ids),
        output_plan=reply.token_ids,
        max_tokens=length.max_tokens,
        arrival_time=asyncio.get_running_loop().time(),
        do_remote_decode=prefill_only,
        remote_prefill=remote,
        salt=salt_hash(body.cache_salt),
    )
    return w.engine.submit(request)


def _length(body: p.ChatCompletionRequest | p.CompletionRequest, max_tokens: int) -> Length:
    return Length(max_tokens, min(body.min_tokens, max_tokens), body.ignore_eos, tuple(body.stop_strings))


def _reject_unsupported(n: int, logprobs: bool) -> None:
    if n != 1:
        raise p.EngineError(400, "the GPU-free engine generates one choice per request (n=1)", param="n")
    if logprobs:
        raise p.EngineError(400, "the GPU-free engine has no token probabilities to report", param="logprobs")


def _render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    ending: p.ChatCompletionRequest | p.TokenizeChatRequest,
) -> str:
    """The chat template; what it rejects is the client's error, as in vLLM."""
    try:
        return render_chat(messages, tools, ending.add_generation_prompt, ending.continue_final_message)
    except ValueError as exc:
        raise p.EngineError(400, str(exc)) from exc


def _tools(tools: list[p.Tool] | None) -> list[dict[str, Any]] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _completion_prompt(w: SimWorker, body: p.CompletionRequest) -> tuple[str, list[int]]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise p.EngineError(400, "the GPU-free engine takes one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, w.encode_prompt(BOS + prompt)
    if not prompt or any(not 0 <= t < w.tokenizer.vocab_size for t in prompt):
        raise p.EngineError(400, "prompt token ids must be non-empty and inside the vocabulary", param="prompt")
    return " ".join(map(str, prompt)), list(prompt)


async def _run_to_end(w: SimWorker, stream: RequestStream, request: Request) -> tuple[int, StreamEvent] | Response:
    """(tokens generated, final event) of a non-streamed request, or the response to
    send instead: 500 if it failed, 499 if the client went away (it is then aborted
    and its KV freed, as vLLM does)."""
    events = await _collect(w, stream, request)
    if events is None:
        return Response(status_code=499)
    if events[-1].error:
        return JSONResponse(p.error_body(500, "Internal server error", "InternalServerError"), status_code=500)
    return sum(len(e.token_ids) for e in events), events[-1]


async def _collect(w: SimWorker, stream: RequestStream, request: Request) -> list[StreamEvent] | None:
    """All of a request's events; None if the client went away first."""
    events: list[StreamEvent] = []

    async def consume() -> None:
        while True:
            event = await stream.events.get()
            events.append(event)
            if event.finished:
                return

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(_disconnected(request))
    done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if consumer not in done:
        consumer.cancel()
        w.engine.abort(stream.request.request_id)
        return None
    return events


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: AsyncIterator[str], w: SimWorker, stream: RequestStream) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        finished = False
        try:
            async for chunk in body:
                yield chunk
            finished = True
        finally:
            if not finished:  # the client went away mid-stream
                w.engine.abort(stream.request.request_id)

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def _events(stream: RequestStream) -> AsyncIterator[StreamEvent]:
    while True:
        event = await stream.events.get()
        yield event
        if event.finished:
            return


def _stream_error() -> str:
    return p.sse(p.error_body(500, "Internal server error", "InternalServerError")) + p.sse("[DONE]")


async def _chat_stream(
    w: SimWorker, body: p.ChatCompletionRequest, ids: p.ResponseIds, stream: RequestStream, reply: Reply
) -> AsyncIterator[str]:
    options = body.stream_options or p.StreamOptions()
    continuous = options.include_usage and options.continuous_usage_stats
    deltas = p.chat_deltas(reply, body.parses_tools)
    n = 0
    streamed_call = False
    async for event in _events(stream):
        if event.error:
            yield _stream_error()
            return
        if n == 0:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            extra = {"usage": w.usage(stream, 0).body(details=False)} if continuous else {}
            yield p.sse(p.chunk(ids, role, prompt_token_ids=None, prompt_text=None, **extra))
        delta = _merge([deltas[i] for i in range(n, n + len(event.token_ids))])
        n += len(event.token_ids)
        streamed_call = streamed_call or bool(delta and delta.get("tool_calls"))
        if not event.finished:
            if delta is not None:
                yield p.delta_chunk_sse(ids, delta, w.usage(stream, n) if continuous else None)
            continue
        extra = {"usage": w.usage(stream, n).body(details=False)} if continuous else {}
        done = reply.prefix(n)
        reason = event.finish_reason or "stop"
        if streamed_call and reason == "stop" and not isinstance(body.effective_tool_choice, dict):
            reason = "tool_calls"
        choice = {
            "index": 0,
            "delta": delta or {},
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": done.stop_reason if event.finish_reason == "stop" else None,
            "token_ids": None,
        }
        if not options.include_usage:
            extra["system_fingerprint"] = ids.fingerprint
        yield p.sse(p.chunk(ids, choice, **extra))
        if options.include_usage:
            usage = w.usage(stream, n).final_stream_body()
            yield p.sse(p.chunk(ids, None, usage=usage, system_fingerprint=ids.fingerprint))
        yield p.sse("[DONE]")


async def _completion_stream(
    w: SimWorker, body: p.CompletionRequest, ids: p.ResponseIds, stream: RequestStream, reply: Reply, echo: str
) -> AsyncIterator[str]:
    options = body.stream_options or p.StreamOptions()
    continuous = options.include_usage and options.continuous_usage_stats
    n = 0
    async for event in _events(stream):
        if event.error:
            yield _stream_error()
            return
        text = (echo if n == 0 else "") + "".join(reply.pieces[n : n + len(event.token_ids)])
        n += len(event.token_ids)
        done = reply.prefix(n)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": event.finish_reason if event.finished else None,
            "stop_reason": done.stop_reason if event.finish_reason == "stop" else None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        extra: dict[str, Any] = {"usage": w.usage(stream, n).body(details=False)} if continuous else {}
        if event.finished and not options.include_usage:
            extra["system_fingerprint"] = ids.fingerprint
        yield p.sse(p.chunk(ids, choice, **extra))
        if event.finished:
            if options.include_usage:
                usage = w.usage(stream, n).final_stream_body()
                yield p.sse(p.chunk(ids, None, usage=usage, system_fingerprint=ids.fingerprint))
            yield p.sse("[DONE]")


def _merge(deltas: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Deltas of several tokens that arrived in one step, as one delta (or None)."""
    present = [d for d in deltas if d is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    calls = [c for d in present for c in d.get("tool_calls") or []]
    if calls:
        return {"content": None, "tool_calls": calls}
    return {"content": "".join(d.get("content") or "" for d in present)}


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise p.EngineError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise p.EngineError(400, "request body must be a JSON object")
    return body


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise p.EngineError(400, _validation_message(exc.errors()), "Bad Request", _param(exc.errors())) from exc


def _validation_body(errors: Any) -> dict[str, Any]:
    return p.error_body(400, _validation_message(errors), "Bad Request", _param(errors))


def _validation_message(errors: Any) -> str:
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}" for e in errors]
    return f"{len(parts)} validation error{'s' if len(parts) != 1 else ''}: " + "; ".join(parts)


def _param(errors: Any) -> str | None:
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if loc:
            return loc[0]
    return None
