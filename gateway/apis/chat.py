"""OpenAI's chat completions (``POST /v1/chat/completions``), relayed as the engines speak it.

The hot path: served straight from the ASGI call, off FastAPI's routing and middleware
(gateway.apis.app.HotPath); the route is registered here all the same, so the OpenAPI
document describes it and a plain FastAPI app serves it too. Chat has no place for
server-side tool calls: a completion lists them, with what each tool returned, in the
extension field ``ampd_tool_rounds`` (a stream in ``ampd_tool_round`` chunks, gateway.tool_loop).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response

from gateway.apis.relay import relay
from gateway.apis.schema import APIError

CHAT_PATH = "/v1/chat/completions"

router = APIRouter()


@router.post(CHAT_PATH)
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completions, relayed as the engines speak it."""
    r = relay(request)
    scope, raw = await r.begin(request)
    started = await r.start(raw, request, scope)
    if raw.get("stream"):
        return r.streaming(started.first, started.events, chat_failure, started)
    await r.finish(started)
    body = started.client.completion()
    if started.ex.rounds:  # chat has no place for server-side tool calls: an extension field
        body["ampd_tool_rounds"] = started.ex.rounds
    return r.ok(body, started)


def chat_failure(error: APIError) -> bytes:
    """A failure after the stream began, as vLLM writes it for chat: an error event, then ``[DONE]``."""
    return f"data: {json.dumps(error.body())}\n\n".encode() + b"data: [DONE]\n\n"
