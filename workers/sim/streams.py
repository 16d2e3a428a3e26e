"""The server-sent event bodies of streamed requests, chunk by chunk as vLLM 0.32 writes them.

A stream is a plain generator over the engine's events: the worker and everything else it
needs are resolved once, when the request arrives, not per chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from workers.sim import protocol as p
from workers.sim.engine import RequestStream, StreamEvent
from workers.sim.responder import Reply
from workers.sim.worker import SimWorker


def sse_response(body: AsyncIterator[str], w: SimWorker, stream: RequestStream) -> StreamingResponse:
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


async def chat_stream(
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


async def completion_stream(
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


async def _events(stream: RequestStream) -> AsyncIterator[StreamEvent]:
    while True:
        event = await stream.events.get()
        yield event
        if event.finished:
            return


def _stream_error() -> str:
    return p.sse(p.error_body(500, "Internal server error", "InternalServerError")) + p.sse("[DONE]")
