"""Anthropic's Messages API (``POST /v1/messages``), translated at the edge to chat completions.

A Messages request becomes a chat-completions body (:func:`to_chat`) that goes through
the gateway's one path - session binding, routing, queueing, server-side tools - and
the chat reply comes back as an Anthropic ``message`` (:func:`message_object`) or, for
a streaming client, as Anthropic's events (:class:`MessageEvents`): ``message_start``,
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``.

Mapping: ``system`` (a string or text blocks) is the system message; a user turn's
``tool_result`` blocks are ``tool`` messages (before the turn's text), an assistant
turn's ``tool_use`` blocks its ``tool_calls``; tools (``input_schema``) are chat
function tools; ``tool_choice`` auto/any/tool/none is auto/required/a named
function/none; ``stop_sequences`` is ``stop``; ``max_tokens`` (required) stays.
``metadata.user_id`` names the session when nothing else does (gateway.state.sessions).
Fields the Messages API does not define (``server_tools``, ``sim_script``, ...) pass
through. The server-side tool calls the gateway ran are ``mcp_tool_use`` blocks, each
followed by its ``mcp_tool_result`` (the tool's text, ``is_error`` where it failed), as
Anthropic gives the calls an MCP server ran; an assistant turn sent back with them has
them skipped (the session's transcript holds them). Errors have Anthropic's shape
(:func:`error_body`). Everything here but the routes is pure.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.apis.relay import joined, relay, translated, upstream_api_error
from gateway.apis.schema import APIError, Origins, validation_error
from gateway.engines.upstream import UpstreamError
from gateway.tool_loop import SERVER_NAME, ToolRound

MESSAGES_PATH = "/v1/messages"

# Fields of a Messages request that mean nothing to chat completions (or are mapped by hand).
MESSAGES_ONLY = frozenset({
    "system", "messages", "tools", "tool_choice", "stop_sequences", "metadata", "thinking", "service_tier",
    "container", "mcp_servers", "context_management", "anthropic_version", "anthropic_beta",
})  # fmt: skip

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


class Turn(BaseModel):
    """One message of the conversation: its content a string or a list of content blocks."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """What the gateway checks of a Messages request before translating it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Turn] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """Anthropic's ``count_tokens``: a Messages request but for ``max_tokens``."""

    max_tokens: int | None = Field(default=None, ge=1)


def parse_request(raw: Mapping[str, Any], model: type[MessagesRequest] = MessagesRequest) -> MessagesRequest:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(16)}"


# -- request: Messages -> chat ----------------------------------------------------------------


def to_chat(raw: Mapping[str, Any], request: MessagesRequest) -> tuple[dict[str, Any], Origins]:
    """The chat-completions body for a Messages request, and where its messages came from."""
    messages: list[dict[str, Any]] = []
    paths: list[str] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else _texts(request.system, "system")
        messages.append({"role": "system", "content": system})
        paths.append("system")
    for i, message in enumerate(request.messages):
        turn, turn_paths = _turn(message.model_dump(), f"messages.{i}")
        messages += turn
        paths += turn_paths
    body = {k: v for k, v in raw.items() if k not in MESSAGES_ONLY}
    body["messages"] = messages
    if request.tools:
        body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(request.tools)]
    if request.tool_choice is not None:
        choice, parallel = chat_tool_choice(request.tool_choice)
        body["tool_choice"] = choice
        if parallel is False:
            body["parallel_tool_calls"] = False
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    session = session_hint((request.metadata or {}).get("user_id"))
    if session:
        body["metadata"] = {"session_id": session}
    origins = Origins(paths, "a tool_result block must answer a tool_use block of the assistant message before it",
                      "tool_use_id {id} answers no tool_use block of the assistant message before it",
                      {"stop": "stop_sequences"})  # fmt: skip
    return body, origins


def session_hint(user_id: Any) -> str | None:
    """The session ``metadata.user_id`` names. Claude Code puts its session in it, as
    ``..._session_<id>`` or as JSON with a ``session_id``; any other value is taken whole."""
    if not isinstance(user_id, str) or not user_id:
        return None
    try:
        decoded = json.loads(user_id)
    except json.JSONDecodeError:
        decoded = None
    if isinstance(decoded, dict) and decoded.get("session_id"):
        return str(decoded["session_id"])
    head, marker, session = user_id.rpartition("_session_")
    return session if marker and head and session else user_id


def _turn(message: Mapping[str, Any], where: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One turn as chat messages (its tool results first, each a ``tool`` message), and
    where each came from: the turn, or its tool_result block."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role: must be 'user' or 'assistant'", param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}], [where]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: a string or a list of content blocks", param="messages")
    results: list[dict[str, Any]] = []
    paths: list[str] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image" and role == "user":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not block.get("id") or not block.get("name"):
                raise APIError(400, f"{at}: a tool_use block needs an id and a name", param="messages")
            arguments = json.dumps(block.get("input") or {})
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": arguments}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            if not block.get("tool_use_id"):
                raise APIError(400, f"{at}: a tool_result block needs the tool_use_id it answers", param="messages")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result(block, at)})
            paths.append(at)
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the engine's reasoning is not replayed to it
        elif kind in ("mcp_tool_use", "mcp_tool_result") and role == "assistant":
            continue  # a server-side tool call the gateway ran: the session's transcript holds it
        else:
            raise APIError(400, f"{at}: {kind!r} blocks are not supported in a {role} message", param="messages")
    out = list(results)
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        reply: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            reply["tool_calls"] = calls
        out.append(reply)
    elif parts:
        texts_only = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if texts_only else parts})
    return out, paths + [where] * (len(out) - len(paths))


def _texts(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list) or not all(isinstance(b, dict) and b.get("type") == "text" for b in blocks):
        raise APIError(400, f"{where}: only text blocks are supported", param=where.split(".")[0])
    return "".join(str(b.get("text", "")) for b in blocks)


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
        return {"type": "image_url", "image_url": {"url": url}}
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url")}}
    raise APIError(400, f"{where}.source: a base64 or url image source", param="messages")


def _result(block: Mapping[str, Any], where: str) -> str:
    content = block.get("content", "")
    text = content if isinstance(content, str) else _texts(content or [], f"{where}.content")
    return f"Error: {text}" if block.get("is_error") and not text.startswith("Error") else text


def _tool(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom") or not tool.get("name"):
        raise APIError(400, f"{where}: only client tools ({{name, description, input_schema}}) are supported",
                       param="tools")  # fmt: skip
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Mapping[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    """Anthropic's tool_choice as chat's, and whether parallel tool use is allowed."""
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice.type: one of 'auto', 'any', 'tool' (with a name) or 'none'", param="tool_choice")


# -- reply: chat -> Messages ------------------------------------------------------------------


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat assistant message as Anthropic content blocks: its text, then its tool uses."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": _input(call["function"]["arguments"])})  # fmt: skip
    return blocks


def mcp_blocks(rounds: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The server-side tool rounds the gateway ran (gateway.tool_loop.ToolRound) as
    content blocks: each call an ``mcp_tool_use`` block, then its ``mcp_tool_result``."""
    blocks: list[dict[str, Any]] = []
    for tool_round in rounds:
        for call in ToolRound.model_validate(tool_round).calls:
            use_id = f"mcptoolu_{secrets.token_hex(12)}"
            blocks.append({"type": "mcp_tool_use", "id": use_id, "name": call.name, "server_name": SERVER_NAME,
                           "input": _input(call.arguments)})  # fmt: skip
            blocks.append({"type": "mcp_tool_result", "tool_use_id": use_id, "is_error": not call.ok,
                           "content": [{"type": "text", "text": call.output}]})  # fmt: skip
    return blocks


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"_raw": arguments}  # the model's malformed JSON, kept rather than lost


def stop_reason(
    finish_reason: str | None, engine_stop: Any, stop_sequences: list[str] | None, has_calls: bool
) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and stop_sequence) for a chat finish_reason; vLLM's
    ``stop_reason`` is the stop string that ended the reply, if one did."""
    if finish_reason == "tool_calls" or (has_calls and finish_reason == "stop"):
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str) and engine_stop in (stop_sequences or []):
        return "stop_sequence", engine_stop
    return "end_turn", None


def usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any]:
    chat_usage = chat_usage or {}
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    prompt, completion = int(chat_usage.get("prompt_tokens") or 0), int(chat_usage.get("completion_tokens") or 0)
    return {"input_tokens": prompt, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": completion}  # fmt: skip


def message_object(
    message_id: str,
    model: str,
    message: Mapping[str, Any],
    finish_reason: str | None,
    engine_stop: Any,
    stop_sequences: list[str] | None,
    chat_usage: Mapping[str, Any] | None,
    tool_rounds: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """An Anthropic ``message`` from the chat reply, after the server-side tool rounds that led to it."""
    reason, sequence = stop_reason(finish_reason, engine_stop, stop_sequences, bool(message.get("tool_calls")))
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": mcp_blocks(tool_rounds) + content_blocks(message), "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(chat_usage)}  # fmt: skip


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


class MessageEvents:
    """Anthropic's streaming events for one message, from chat chunks: text becomes a
    ``text`` block, each tool call a ``tool_use`` block whose input streams as
    ``input_json_delta``, each server-side tool round announced its ``mcp_tool_use`` and
    ``mcp_tool_result`` blocks, whole (the tools have run by then); ``finish`` closes the
    open block and sends the stop reason and usage in ``message_delta``, then ``message_stop``."""

    def __init__(self, message_id: str, model: str, input_tokens: int, stop_sequences: list[str] | None) -> None:
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.stop_sequences = stop_sequences
        self._blocks = 0  # blocks started so far
        self._open: str | None = None  # the open block's type: "text", "tool_use" or an mcp block's
        self._calls: dict[int, int] = {}  # chat tool call index -> block index
        self._has_calls = False

    def start(self) -> list[bytes]:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}  # fmt: skip
        return [sse({"type": "message_start", "message": message}), sse({"type": "ping"})]

    def feed(self, chunk: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self._open != "text":
                    out += self._close()
                    out.append(self._start_block({"type": "text", "text": ""}, "text"))
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        if "ampd_tool_round" in chunk:
            out += self._close()
            for block in mcp_blocks([chunk["ampd_tool_round"]]):
                out += [self._start_block(block, block["type"]), *self._close()]
        return out

    def _call(self, call: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        function = call.get("function") or {}
        index = int(call.get("index", 0))
        if index not in self._calls:
            out += self._close()
            self._calls[index] = self._blocks
            self._has_calls = True
            block = {"type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or "", "input": {}}
            out.append(self._start_block(block, "tool_use"))
        if function.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            out.append(sse({"type": "content_block_delta", "index": self._calls[index], "delta": delta}))
        return out

    def _start_block(self, block: dict[str, Any], kind: str) -> bytes:
        self._open = kind
        self._blocks += 1
        return sse({"type": "content_block_start", "index": self._blocks - 1, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse({"type": "content_block_stop", "index": self._blocks - 1})]

    def finish(self, finish_reason: str | None, engine_stop: Any, chat_usage: Mapping[str, Any] | None) -> list[bytes]:
        reason, sequence = stop_reason(finish_reason, engine_stop, self.stop_sequences, self._has_calls)
        counts = usage(chat_usage)
        counted = {"input_tokens": counts["input_tokens"], "output_tokens": counts["output_tokens"]}
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": counted}
        return [*self._close(), sse(delta), sse({"type": "message_stop"})]

    def fail(self, error: APIError) -> list[bytes]:
        return [sse(error_body(error))]


router = APIRouter()


@router.post(MESSAGES_PATH)
async def messages(request: Request) -> Response:
    """Anthropic's Messages API; the key in ``x-api-key`` or as a Bearer token."""
    r = relay(request)
    scope, raw = await r.begin(request, api_key_header=True)
    asked = parse_request(raw)
    chat, origins = to_chat(raw, asked)
    started = await r.start(chat, request, scope, origins=origins)
    message_id, client = new_message_id(), started.client
    if asked.stream:
        prompt = started.first_round.plan.task.l_total
        stream = MessageEvents(message_id, started.model, prompt, asked.stop_sequences)

        def stopped() -> list[bytes]:
            return stream.finish(client.finish_reason, client.stop_reason, client.usage)

        relayed = translated(started, stream.feed, None, stopped)
        return r.streaming(b"".join(stream.start()), relayed, joined(stream.fail), started)
    await r.finish(started)
    body = message_object(message_id, started.model, client.message(), client.finish_reason, client.stop_reason,
                          asked.stop_sequences, client.usage, started.ex.rounds)  # fmt: skip
    return r.ok(body, started)


@router.post(f"{MESSAGES_PATH}/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """Anthropic's token counting: the prompt a Messages request would have, counted by an engine."""
    r = relay(request)
    _, raw = await r.begin(request, api_key_header=True)  # counted, not run: no session
    asked = parse_request(raw, CountTokensRequest)
    chat, origins = to_chat(raw, asked)
    try:
        return {"input_tokens": await r.gateway.count(chat)}
    except UpstreamError as exc:
        raise origins.error(upstream_api_error(exc)) from exc
    except APIError as exc:
        raise origins.error(exc) from exc
