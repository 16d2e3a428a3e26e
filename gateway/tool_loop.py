"""Server-side tools in the conversation: what the client sees of a multi-round answer.

When a request enables server-side tools, one client request can take several engine
rounds: the model calls a server tool, the gateway runs it (tools_sandbox, through
rq) and prefills the result as the next round (AMPD section 3: the interaction's
completion creates an incremental prefill task). The client receives one completion:

* content streams from every round as it is generated;
* server-side tool calls are hidden, client-side ones pass (re-indexed from 0);
* a finish reason appears once, at the end of the last round;
* between rounds a chunk with no choices announces the round in ``ampd_tool_round``:
  each call the gateway ran, with what its tool returned (:class:`ToolRound`), which the
  Responses and Messages APIs render as their own server-side tool items.

The engine, meanwhile, sees the true conversation - every assistant turn and tool
result - which the gateway keeps as the session's transcript (gateway.state.sessions).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from gateway.engines.upstream import Reply
from tools_sandbox.outcome import Outcome

SERVER_NAME = "ampd"  # the tool server the translated APIs name (an MCP server's label there)


class ClientView:
    """Rewrites one round's engine chunks into the client's stream (``None``: drop)."""

    def __init__(self, server_tools: frozenset[str], engine: Reply, client: Reply, last_round: bool) -> None:
        self.server_tools, self.engine, self.client, self.last_round = server_tools, engine, client, last_round
        self._client_index: dict[int, int] = {}

    def __call__(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if not chunk.get("choices"):
            return None  # the engine's usage chunk: the client gets the sum over rounds at the end
        choices = [c for c in (self._choice(choice) for choice in chunk["choices"]) if c is not None]
        if not choices:
            return None
        out = dict(chunk, choices=choices)
        if self.client.head is not None:  # one completion: keep the first round's id
            out["id"] = self.client.head["id"]
        self.client.observe(out, time.time())
        return out

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        delta = dict(choice.get("delta") or {})
        if "role" in delta and self.client.head is not None:
            del delta["role"]  # only the first round opens the message
        calls = delta.pop("tool_calls", None) or []
        kept = [dict(c, index=self._index(c["index"])) for c in calls if not self._server(c["index"])]
        if kept:
            delta["tool_calls"] = kept
        finish = choice.get("finish_reason")
        if finish is not None:
            finish = self.finish_reason(finish)
        if finish is None and not delta.get("role") and not delta.get("content") and not kept:
            return None
        return dict(choice, delta=delta, finish_reason=finish)

    def finish_reason(self, engine_reason: str) -> str | None:
        """The client's finish reason for this round's end (None: more rounds follow)."""
        if not self.server_calls():
            return engine_reason
        if self.client_calls():
            return "tool_calls"  # mixed: the client has calls of its own to run
        return "length" if self.last_round else None  # out of tool rounds

    def server_calls(self) -> list[dict[str, Any]]:
        return [c for c in self.engine.tool_calls if c["function"]["name"] in self.server_tools]

    def client_calls(self) -> list[dict[str, Any]]:
        return [c for c in self.engine.tool_calls if c["function"]["name"] not in self.server_tools]

    def _server(self, index: int) -> bool:
        return self.engine.tool_calls[index]["function"]["name"] in self.server_tools

    def _index(self, engine_index: int) -> int:
        return self._client_index.setdefault(engine_index, len(self._client_index))


def tool_messages(calls: Iterable[dict[str, Any]], outcomes: Iterable[Outcome]) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "tool_call_id": call["id"], "content": outcome.content}
        for call, outcome in zip(calls, outcomes, strict=True)
    ]


def announcement(head: dict[str, Any], round_index: int, calls: list[dict[str, Any]], outcomes: list[Outcome]) -> dict:
    """The chunk that tells a streaming client a server-side tool round happened."""
    return {
        "id": head.get("id"),
        "object": "chat.completion.chunk",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": [],
        "ampd_tool_round": round_summary(round_index, calls, outcomes),
    }


class ServerCall(BaseModel):
    """A server-side tool call as the client sees it: what the model asked, and what the
    tool returned - the text the model read next, which is the error where ``ok`` is false."""

    id: str
    name: str
    arguments: str
    ok: bool
    output: str


class ToolRound(BaseModel):
    """A round's server-side tool calls: ``ampd_tool_round`` in a chat stream, an entry of
    ``ampd_tool_rounds`` in a chat completion."""

    round: int
    calls: list[ServerCall]


def round_summary(round_index: int, calls: list[dict[str, Any]], outcomes: list[Outcome]) -> dict[str, Any]:
    """A round's server-side calls and what each tool returned, as the client gets them."""
    ran = [
        ServerCall(
            id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"], ok=o.ok, output=o.content
        )
        for c, o in zip(calls, outcomes, strict=True)
    ]
    return ToolRound(round=round_index, calls=ran).model_dump()
