"""The gateway's OpenAI-compatible request schema and errors.

Requests are validated only as far as the gateway needs (roles, tool shapes, limits)
and otherwise passed through to the engine untouched, so every field vLLM accepts
(temperature, top_p, seed, stop, ...) still reaches it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        499: "client_closed_request",
        502: "upstream_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Open):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Open):
    include_usage: bool = False


class ChatRequest(_Open):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    server_tools: list[str] | None = Field(default=None, description="server-side tools to enable (ampd extension)")
    cache_salt: str | None = Field(default=None, min_length=1, description="vLLM's prefix-cache salt")


class ToolOrder(APIError):
    """A tool result out of place: at chat message ``index``, answering no call before it
    (``call_id`` None: no call at all). An API translated to chat words it in its own
    fields (:class:`Origins`)."""

    def __init__(self, index: int, call_id: str | None) -> None:
        if call_id is None:
            words = "a 'tool' message must follow an assistant message with 'tool_calls'"
        else:
            words = f"tool_call_id {call_id!r} answers no call of the assistant message before it"
        super().__init__(400, f"messages.{index}: {words}", param="messages")
        self.index, self.call_id = index, call_id


def check_tool_messages(messages: list[Message]) -> None:
    """Each ``tool`` message answers a call of the assistant message before it (tool
    messages in between): a result with no call would reach the model out of context."""
    calls: set[str] | None = None  # ids the current assistant turn called; None: no calls to answer
    for i, message in enumerate(messages):
        if message.role == "assistant":
            calls = {c.id for c in message.tool_calls or []} if message.tool_calls else None
        elif message.role == "tool":
            if calls is None:
                raise ToolOrder(i, None)
            if message.tool_call_id and "" not in calls and message.tool_call_id not in calls:
                raise ToolOrder(i, message.tool_call_id)
        else:
            calls = None


@dataclass(frozen=True)
class Origins:
    """Where a translated chat body's parts came from in the caller's API (Responses,
    Messages), so that an error about the chat body - the gateway's or the engine's -
    names the caller's own fields: ``messages`` holds each chat message's path ("input.2"),
    ``fields`` chat's field names as the caller's ("max_tokens" -> "max_output_tokens"),
    ``orphan`` and ``unanswered`` (with ``{id}``) word a :class:`ToolOrder`."""

    messages: list[str]
    orphan: str
    unanswered: str
    fields: Mapping[str, str] = field(default_factory=dict)

    def error(self, exc: APIError) -> APIError:
        if isinstance(exc, ToolOrder):
            words = self.orphan if exc.call_id is None else self.unanswered.format(id=repr(exc.call_id))
            return APIError(400, f"{self._path(exc.index)}: {words}", param=self._field("messages"))
        message = re.sub(r"\bmessages\.(\d+)", lambda m: self._path(int(m[1])), exc.message)
        for chat, theirs in self.fields.items():
            message = re.sub(rf"\b{re.escape(chat)}\b", theirs, message)
        param = self._field(exc.param) if exc.param else None
        return APIError(exc.status, message, param, exc.code)

    def _path(self, index: int) -> str:
        return self.messages[index] if index < len(self.messages) else f"messages.{index}"

    def _field(self, name: str) -> str:
        return self.fields.get(name, name)


def validation_error(exc: ValidationError | Any) -> APIError:
    errors = exc.errors() if hasattr(exc, "errors") else []
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ())]
    loc = loc[1:] if loc[:1] in (["body"], ["query"], ["path"]) else loc  # where FastAPI found it
    where = ".".join(loc)
    return APIError(
        400, f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request", loc[0] if loc else None
    )
