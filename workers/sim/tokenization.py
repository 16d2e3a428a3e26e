"""``POST /tokenize``: vLLM's tokenizer endpoint, a chat's rendered prompt or a completion's."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from workers.sim import protocol as p
from workers.sim.errors import parse
from workers.sim.prompt import render, tool_dicts
from workers.sim.tokenizer import BOS
from workers.sim.worker import WorkerDep

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request, w: WorkerDep) -> dict[str, Any]:
    body = await _json_body(request)
    if "messages" in body:
        chat = parse(p.TokenizeChatRequest, body)
        w.check_model(chat.model)
        text = render(p.message_dicts(chat.messages), tool_dicts(chat.tools), chat)
    else:
        plain = parse(p.TokenizeCompletionRequest, body)
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


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise p.EngineError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise p.EngineError(400, "request body must be a JSON object")
    return body
