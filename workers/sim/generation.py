"""The OpenAI generation routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each request is checked by vLLM's rules, scripted by the responder, submitted to the
engine (with the hand-off of its ``kv_transfer_params``), and answered whole or streamed
(workers.sim.streams).
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rounds.engine.request import Request as EngineRequest
from workers.sim import protocol as p
from workers.sim.engine import RequestStream, StreamEvent
from workers.sim.prompt import completion_prompt, render, tool_dicts
from workers.sim.responder import Length, Reply, ScriptError
from workers.sim.streams import chat_stream, completion_stream, sse_response
from workers.sim.worker import SimWorker, WorkerDep

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: p.ChatCompletionRequest, request: Request, w: WorkerDep):
    w.check_model(body.model)
    _reject_unsupported(body.n, body.logprobs)
    messages, tools = p.message_dicts(body.messages), tool_dicts(body.tools)
    prompt_ids = w.encode_prompt(render(messages, tools, body))
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
        return sse_response(chat_stream(w, body, ids, stream, reply), w, stream)
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


@router.post("/v1/completions")
async def completions(body: p.CompletionRequest, request: Request, w: WorkerDep):
    w.check_model(body.model)
    _reject_unsupported(body.n, bool(body.logprobs))
    prompt_text, prompt_ids = completion_prompt(w, body)
    length = _length(body, w.max_tokens_for(len(prompt_ids), body.max_tokens, "max_tokens"))
    reply = w.responder.completion(body.sim_script, body.seed, length)
    ids = p.ResponseIds(f"cmpl-{_request_id(request)}", w.config.model_name, "text_completion")
    stream = _submit(w, ids, prompt_ids, reply, length, body)
    echo = prompt_text if body.echo else ""
    if body.stream:
        return sse_response(completion_stream(w, body, ids, stream, reply, echo), w, stream)
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
        cache_salt=body.cache_salt,
    )
    return w.engine.submit(request)


def _length(body: p.ChatCompletionRequest | p.CompletionRequest, max_tokens: int) -> Length:
    return Length(max_tokens, min(body.min_tokens, max_tokens), body.ignore_eos, tuple(body.stop_strings))


def _reject_unsupported(n: int, logprobs: bool) -> None:
    if n != 1:
        raise p.EngineError(400, "the GPU-free engine generates one choice per request (n=1)", param="n")
    if logprobs:
        raise p.EngineError(400, "the GPU-free engine has no token probabilities to report", param="logprobs")


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
