"""OpenAI's Responses API (``POST /v1/responses``), translated at the edge to chat completions.

A Responses request becomes a chat-completions body (:func:`to_chat`) that goes through
the gateway's one path - session binding, routing, queueing, server-side tools - and
the chat reply comes back as a ``response`` object (:func:`response_object`) or, for a
streaming client, as the Responses API's semantic events (:class:`ResponseEvents`).

Mapping: ``instructions`` is the system message; ``input`` is a string (one user
message) or a list of items - ``message`` items (``input_text``/``output_text``/
``input_image`` parts), ``function_call`` items (an assistant turn's tool calls) and
``function_call_output`` items (``tool`` messages); function tools in their flat
shape become chat tools; ``max_output_tokens`` is ``max_tokens``; ``text.format`` is
``response_format``. Fields the Responses API does not define (``server_tools``,
``sim_script``, vLLM's sampling extras) pass through to the chat body, as they do
on ``/v1/chat/completions``. The server-side tool calls the gateway ran are ``mcp_call``
output items, as OpenAI gives the calls an MCP server ran: the tool's text in ``output``
or, where it failed, in ``error``; as input they are skipped (the session's transcript
holds them).

``previous_response_id``: every response the client lets the gateway store (``store``,
true by default) is kept in Redis - the conversation as chat messages including the
reply, the session it ran in - for the session's TTL, under the caller's key scope
(:class:`ResponseStore`). A request naming it continues that conversation in that same
session; ``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``
read and forget the stored response. Errors about the chat body name the Responses
fields they came from (gateway.apis.schema.Origins). Everything here but
:class:`ResponseStore` and the routes is pure: dicts in, dicts out.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.apis.relay import joined, relay, translated
from gateway.apis.schema import APIError, Origins, validation_error
from gateway.state.outage import REDIS_DOWN
from gateway.state.sessions import canonical_message
from gateway.tool_loop import SERVER_NAME, ToolRound

# Fields of a Responses request that mean nothing to chat completions (or are mapped by hand).
RESPONSES_ONLY = frozenset({
    "input", "instructions", "max_output_tokens", "previous_response_id", "store", "reasoning", "text",
    "truncation", "include", "background", "conversation", "prompt", "service_tier", "max_tool_calls",
    "top_logprobs", "safety_identifier", "stream_options", "tools", "tool_choice", "prompt_cache_retention",
})  # fmt: skip


class ResponsesRequest(BaseModel):
    """What the gateway checks of a Responses request before translating it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def parse_request(raw: Mapping[str, Any]) -> ResponsesRequest:
    try:
        return ResponsesRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


# -- request: Responses -> chat ---------------------------------------------------------------


RESPONSES_ORIGINS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def to_chat(
    raw: Mapping[str, Any], request: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[dict[str, Any], Origins]:
    """The chat-completions body for a Responses request, and where its messages came
    from; ``history`` is the stored conversation of ``previous_response_id`` (chat
    messages, the reply included)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages += history
    paths = ["instructions"] * bool(request.instructions) + ["previous_response_id"] * len(history)
    new, new_paths = input_messages(request.input)
    if not new:
        raise APIError(400, "input: no message to answer", param="input")
    skipped = _echoed(history, new)
    messages += new[skipped:]
    paths += new_paths[skipped:]
    body = {k: v for k, v in raw.items() if k not in RESPONSES_ONLY}
    body["messages"] = messages
    if request.tools:
        body["tools"] = chat_tools(request.tools)
    if request.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(request.tool_choice)
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    response_format = _response_format(request.text)
    if response_format is not None:
        body["response_format"] = response_format
    conversation = request.conversation
    conversation_id = conversation.get("id") if isinstance(conversation, dict) else conversation
    metadata = dict(request.metadata or {})
    if conversation_id and not metadata.get("session_id"):  # the Responses API's own conversation: a session
        body["metadata"] = metadata | {"session_id": str(conversation_id)}
    origins = Origins(paths, "a function_call_output must follow the function_call it answers",
                      "call_id {id} answers no function_call before it", RESPONSES_ORIGINS)  # fmt: skip
    return body, origins


def _echoed(history: list[dict[str, Any]], new: list[dict[str, Any]]) -> int:
    """How many of ``new``'s messages repeat ``history``: the stored reply, when the client
    echoes it back (its function calls, say), is not repeated."""
    return int(bool(history and new) and canonical_message(history[-1]) == canonical_message(new[0]))


def input_messages(input_: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Responses input items as chat messages, and each one's item (``input.3``).
    Consecutive ``function_call`` items and the assistant message before them are one
    assistant turn, as chat completions has it."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}], ["input"]
    messages: list[dict[str, Any]] = []
    paths: list[str] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"{where}.call_id: a function_call_output needs the call_id it answers", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"))})
        elif kind == "reasoning":
            continue  # the engine's reasoning is not replayed to it
        elif kind == "mcp_call":
            continue  # a server-side tool call the gateway ran: the session's transcript holds it
        else:
            raise APIError(400, f"{where}.type: input items of type {kind!r} are not supported", param="input")
        paths.append(where)
    return messages, paths


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"{where}.role: must be one of user, assistant, system, developer", param="input")
    content = item.get("content")
    if isinstance(content, str):
        text: str | list[dict[str, Any]] = content
    elif isinstance(content, list):
        parts = [_part(p, f"{where}.content.{j}") for j, p in enumerate(content)]
        texts = [p["text"] for p in parts if p["type"] == "text"]
        text = "".join(texts) if len(texts) == len(parts) and (role == "assistant" or len(parts) == 1) else parts
    else:
        raise APIError(400, f"{where}.content: a string or a list of content parts", param="input")
    return {"role": "system" if role == "developer" else role, "content": text}


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal", ""))}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise APIError(400, f"{where}: content parts of type {kind!r} are not supported", param="input")


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise APIError(400, f"{where}: a function_call needs a call_id and a name", param="input")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _output_text(output: Any) -> str:
    if isinstance(output, list):
        return "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
    return output if isinstance(output, str) else json.dumps(output)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools (``{type, name, description, parameters, strict}``)
    as chat tools. Hosted tools (web search, file search, ...) are not offered."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools.{i}.type: only function tools are supported, not {tool.get('type')!r}",
                           param="tools")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice: 'none', 'auto', 'required' or {type: 'function', name}", param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


# -- reply: chat -> Responses -----------------------------------------------------------------


def output_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat assistant message as Responses output items: its text, then its calls."""
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(_message_item(f"msg_{secrets.token_hex(16)}", message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(_call_item(f"fc_{secrets.token_hex(16)}", call["id"], function["name"], function["arguments"],
                                "completed"))  # fmt: skip
    return items


def mcp_call_items(rounds: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The server-side tool rounds the gateway ran (gateway.tool_loop.ToolRound) as
    ``mcp_call`` output items, one a call."""
    return [
        {"id": f"mcp_{secrets.token_hex(16)}", "type": "mcp_call", "status": "completed" if call.ok else "failed",
         "server_label": SERVER_NAME, "name": call.name, "arguments": call.arguments,
         "output": call.output if call.ok else None, "error": None if call.ok else call.output}
        for tool_round in rounds
        for call in ToolRound.model_validate(tool_round).calls
    ]  # fmt: skip


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}  # fmt: skip


def response_object(
    response_id: str,
    request: ResponsesRequest,
    model: str,
    created_at: int,
    output: list[dict[str, Any]],
    status: str = "completed",
    usage: Mapping[str, Any] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A Responses ``response`` object; ``usage`` is the engine's chat usage."""
    incomplete = None
    if status == "completed" and finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
        "incomplete_details": incomplete, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "model": model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": request.store, "temperature": request.temperature,
        "text": request.text or {"format": {"type": "text"}},
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [], "top_p": request.top_p,
        "truncation": "disabled", "usage": responses_usage(usage) if usage is not None else None,
        "metadata": request.metadata or {},
    }  # fmt: skip


def responses_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion,
    }  # fmt: skip


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


class ResponseEvents:
    """The Responses API's streaming events for one response, from chat chunks.

    ``start`` opens the response; ``feed`` turns each chat chunk into the output item,
    content part and delta events it implies (text becomes a ``message`` item, each
    tool call a ``function_call`` item, each server-side tool call announced an
    ``mcp_call`` item); ``finish`` closes what is open and completes the
    response. Every event carries a ``sequence_number``."""

    def __init__(self, response_id: str, request: ResponsesRequest, model: str, created_at: int) -> None:
        self.response_id, self.request, self.model, self.created_at = response_id, request, model, created_at
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the output item being streamed
        self._text = ""
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its item
        self.final: dict[str, Any] = {}  # the response as its last event has it, once finished

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(event)

    def _response(self, status: str, usage: Mapping[str, Any] | None = None, finish: str | None = None) -> dict:
        return response_object(self.response_id, self.request, self.model, self.created_at, self.output, status,
                               usage, finish)  # fmt: skip

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]  # fmt: skip

    def feed(self, chunk: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
        if "ampd_tool_round" in chunk:
            out += self._close()
            for item in mcp_call_items([chunk["ampd_tool_round"]]):
                out += self._mcp_call(item)
        return out

    def _mcp_call(self, item: dict[str, Any]) -> list[bytes]:
        """A server-side tool call's events, all at once: the gateway announces a call
        once its tool has run."""
        self.output.append(item)
        index, item_id = self._index(), item["id"]
        ended = "response.mcp_call.completed" if item["status"] == "completed" else "response.mcp_call.failed"
        return [
            self._event("response.output_item.added", output_index=index,
                        item=dict(item, status="in_progress", arguments="", output=None, error=None)),
            self._event("response.mcp_call.in_progress", item_id=item_id, output_index=index),
            self._event("response.mcp_call_arguments.delta", item_id=item_id, output_index=index,
                        delta=item["arguments"]),
            self._event("response.mcp_call_arguments.done", item_id=item_id, output_index=index,
                        arguments=item["arguments"]),
            self._event(ended, item_id=item_id, output_index=index),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]  # fmt: skip

    def _index(self) -> int:
        return len(self.output) - 1

    def _text_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._open is None or self._open["type"] != "message":
            out += self._close()
            item = _message_item(f"msg_{secrets.token_hex(16)}", "", "in_progress")
            self.output.append(item)
            self._open, self._text = item, ""
            out.append(self._event("response.output_item.added", output_index=self._index(), item=dict(item)))
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                   content_index=0, part=_text_part("")))  # fmt: skip
        self._text += text
        out.append(self._event("response.output_text.delta", item_id=self._open["id"], output_index=self._index(),
                               content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return out

    def _call_delta(self, call: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        function = call.get("function") or {}
        index = int(call.get("index", 0))
        item = self._calls.get(index)
        if item is None:
            out += self._close()
            item = _call_item(f"fc_{secrets.token_hex(16)}", call.get("id") or "", function.get("name") or "", "",
                              "in_progress")  # fmt: skip
            self._calls[index] = item
            self.output.append(item)
            self._open = item
            out.append(self._event("response.output_item.added", output_index=self._index(), item=dict(item)))
        elif function.get("name"):
            item["name"] += function["name"]
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=arguments))  # fmt: skip
        return out

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        if item["type"] == "message":
            part = _text_part(self._text)
            item.update(status="completed", content=[part])
            return [
                self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=self._text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=dict(item)),
            ]  # fmt: skip
        item["status"] = "completed"
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]  # fmt: skip

    def finish(self, usage: Mapping[str, Any] | None, finish_reason: str | None) -> list[bytes]:
        out = self._close()
        for item in self.output:  # any call left open by interleaved deltas
            if item["status"] == "in_progress":
                item["status"] = "completed"
        self.final = self._response("completed", usage, finish_reason)
        kind = "response.completed" if self.final["status"] == "completed" else "response.incomplete"
        return [*out, self._event(kind, response=self.final)]

    def fail(self, error: APIError) -> list[bytes]:
        response = self._response("failed")
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return [self._event("response.failed", response=response)]


# -- stored responses -------------------------------------------------------------------------

ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
                 "mcp_call": "mcp"}  # fmt: skip


def input_items(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as ``GET /v1/responses/{id}/input_items`` lists it back: each
    item with an id and a status, a message's text as a content part."""
    items = [{"type": "message", "role": "user", "content": input_}] if isinstance(input_, str) else input_
    return [_listed(item) for item in items]


def _listed(item: Mapping[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    out = {**item, "type": kind}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    out.setdefault("id", f"{ITEM_PREFIXES.get(kind, 'item')}_{secrets.token_hex(16)}")
    out.setdefault("status", "completed")
    return out


def page(items: list[dict[str, Any]], after: str | None, limit: int, order: Literal["asc", "desc"]) -> dict[str, Any]:
    """One page of a stored response's input items, as OpenAI's cursor lists have it."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}  # fmt: skip


class ResponseStore:
    """Stored responses: for ``previous_response_id``, the conversation so far (chat
    messages after the instructions, the reply included) and the session it ran in; for
    ``GET``, the response object and its input items. Keyed by the caller's scope, so
    another key's response id is not found."""

    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int) -> None:
        self.redis, self.p, self.ttl_s = redis, prefix, ttl_s

    def _key(self, scope: str, response_id: str) -> str:
        return f"{self.p}:response:{scope}:{response_id}"

    async def load(self, scope: str, response_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self._key(scope, response_id))
        return None if raw is None else json.loads(raw)

    async def save(
        self,
        scope: str,
        response_id: str,
        session_id: str,
        messages: list[dict[str, Any]],
        response: dict[str, Any],
        items: list[dict[str, Any]],
    ) -> None:
        record = {"session_id": session_id, "messages": messages, "created": time.time(), "response": response,
                  "input_items": items}  # fmt: skip
        await self.redis.set(self._key(scope, response_id), json.dumps(record), ex=self.ttl_s)

    async def delete(self, scope: str, response_id: str) -> bool:
        return bool(await self.redis.delete(self._key(scope, response_id)))


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """OpenAI's Responses API, ``previous_response_id`` included."""
    r = relay(request)
    store: ResponseStore = request.app.state.responses
    scope, raw = await r.begin(request)
    asked = parse_request(raw)
    history, session_id = [], None
    if asked.previous_response_id:
        stored = await store.load(scope, asked.previous_response_id)
        if stored is None:
            raise APIError(404, f"Previous response with id '{asked.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")  # fmt: skip
        history, session_id = stored["messages"], stored["session_id"]
    chat, origins = to_chat(raw, asked, history)
    started = await r.start(chat, request, scope, session_id, origins)
    response_id, created = new_response_id(), int(time.time())
    client = started.client

    async def remember(response: dict[str, Any]) -> None:
        """Store the response, and the conversation after the instructions with the reply.
        Without Redis the answer still stands; only what needs it stored is lost."""
        if not asked.store:
            return
        messages = started.ex.client_messages[1 if asked.instructions else 0 :] + [client.message()]
        try:
            await store.save(scope, response_id, started.ex.session.session_id, messages, response,
                             input_items(asked.input))  # fmt: skip
        except REDIS_DOWN as exc:
            r.gateway.health.failed("response", exc)

    if asked.stream:
        events = ResponseEvents(response_id, asked, started.model, created)

        def completed() -> list[bytes]:
            return events.finish(client.usage, client.finish_reason)

        relayed = translated(started, events.feed, lambda: remember(events.final), completed)
        return r.streaming(b"".join(events.start()), relayed, joined(events.fail), started)
    await r.finish(started)
    output = mcp_call_items(started.ex.rounds) + output_items(client.message())
    body = response_object(response_id, asked, started.model, created, output, "completed", client.usage,
                           client.finish_reason)  # fmt: skip
    await remember(body)
    return r.ok(body, started)


def _store(request: Request) -> tuple[ResponseStore, str]:
    """The stored responses and the caller's scope in them."""
    return request.app.state.responses, relay(request).gateway.authenticate(request.headers.get("authorization"))


async def _stored(request: Request, response_id: str) -> dict[str, Any]:
    store, scope = _store(request)
    stored = await store.load(scope, response_id)
    if stored is None or "response" not in stored:  # a record from before responses were kept whole
        raise not_found(response_id)
    return stored


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response, as it was answered."""
    return (await _stored(request, response_id))["response"]


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> dict[str, Any]:
    """Forget a stored response: neither ``GET`` nor ``previous_response_id`` finds it again."""
    store, scope = _store(request)
    if not await store.delete(scope, response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """The input items of a stored response, newest first unless ``order=asc``."""
    return page((await _stored(request, response_id))["input_items"], after, limit, order)
