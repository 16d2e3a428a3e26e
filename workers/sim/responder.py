"""What the GPU-free engine says: deterministic text or tool calls, optionally scripted.

The "model" of the simulated engine. A reply is planned whole when the request
arrives - its text, its tool calls and its token ids - and the engine core then
emits the planned tokens at the pace the performance model dictates.

Without a script, a request that offers tools gets one call of the first offered
tool (or the one ``tool_choice`` names) until a tool result is in the conversation,
then a text answer. A script (the ``sim_script`` field of the request body) fixes,
per round, the output length and the exact calls, so a trace replays exactly. The
round of a request is the number of assistant turns since the last user message.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from workers.sim.tokenizer import EOS_ID, Tokenizer, message_text, render_tool_call

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "have",
    "not",
    "which",
    "but",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "more",
    "if",
    "has",
    "will",
    "one",
    "their",
    "so",
    "about",
    "what",
    "would",
    "other",
    "into",
    "time",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "model",
    "token",
    "cache",
    "round",
    "tool",
    "agent",
    "answer",
    "prefill",
    "decode",
    "worker",
    "session",
    "route",
    "queue",
    "latency",
    "memory",
    "result",
    "search",
    "document",
]


class ScriptedCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ScriptedRound(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output_tokens: int | None = Field(default=None, ge=1, description="tokens including EOS")
    tool_calls: list[ScriptedCall] = Field(default_factory=list)


class SimScript(BaseModel):
    """Per-round behaviour; rounds past the end of the list answer in text."""

    model_config = ConfigDict(extra="forbid")

    rounds: list[ScriptedRound] = Field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


@dataclass(frozen=True)
class Length:
    """The request's length controls: vLLM's max_tokens, min_tokens, ignore_eos, stop."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reply:
    """A planned reply: ``pieces[i]`` is the text of ``token_ids[i]`` (EOS has none).

    ``stop_reason`` is the stop string that ended it, if one did.
    """

    content: str
    tool_calls: tuple[ToolCall, ...]
    token_ids: list[int]
    pieces: list[str]
    stop_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def after(self, n: int) -> Reply:
        """The rest of the reply once its first ``n`` tokens are out (a continued message)."""
        done = len("".join(self.pieces[:n]))
        return Reply(self.content[done:], self.tool_calls, self.token_ids[n:], self.pieces[n:], self.stop_reason)

    def prefix(self, n: int) -> Reply:
        """The reply as far as its first ``n`` tokens: what a client got if cut there."""
        if n >= len(self.token_ids):
            return self
        pieces = self.pieces[:n]
        text = "".join(pieces)
        calls = tuple(c for c in self.tool_calls if render_tool_call(c.name, json.loads(c.arguments)) in text)
        return Reply(self.content[: len(text)], calls, self.token_ids[:n], pieces)


class ScriptError(ValueError):
    """A script or tool_choice the request's own tools cannot satisfy."""


class Responder:
    def __init__(self, tokenizer: Tokenizer, default_output_tokens: int = 32) -> None:
        self.tokenizer = tokenizer
        self.default_output_tokens = default_output_tokens

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        tool_choice: Any,
        parallel_tool_calls: bool,
        script: SimScript | None,
        seed: int | None,
        length: Length,
        continue_final_message: bool = False,
    ) -> Reply:
        """The reply to a chat request. Continuing a final assistant message, the reply is
        what the same request without that message would have said after its text - the
        same seed continues exactly where an interrupted stream stopped - or, when the
        text is not how that reply begins (an unseeded request), new text after it."""
        if continue_final_message and messages and messages[-1].get("role") == "assistant":
            history, partial = messages[:-1], message_text(messages[-1].get("content"))
            done = len(self.tokenizer.pieces(partial))
            longer = replace(length, max_tokens=length.max_tokens + done)
            whole = self.chat(history, tools, tool_choice, parallel_tool_calls, script, seed, longer)
            if "".join(whole.pieces[:done]) == partial:
                return whole.after(done)
            return self.chat(history, tools, tool_choice, parallel_tool_calls, script, seed, length)
        rng = _rng(seed)
        offered = {t.get("function", {}).get("name"): t.get("function", {}) for t in tools or []}
        planned = self._planned_round(messages, script)
        if planned is not None and planned.tool_calls:
            unknown = [c.name for c in planned.tool_calls if c.name not in offered]
            if unknown:
                raise ScriptError(f"sim_script calls tools the request does not offer: {unknown}")
            calls = [(c.name, c.arguments) for c in planned.tool_calls]
            if not parallel_tool_calls:
                calls = calls[:1]
            return self._reply(rng, planned.output_tokens, calls, length)
        output_tokens = planned.output_tokens if planned is not None else None
        name = _default_tool(messages, offered, tool_choice) if planned is None else None
        if name is None:
            return self._reply(rng, output_tokens, [], length)
        arguments = _arguments_for(offered[name].get("parameters") or {}, messages)
        return self._reply(rng, output_tokens, [(name, arguments)], length)

    def completion(self, script: SimScript | None, seed: int | None, length: Length) -> Reply:
        planned = script.rounds[0] if script and script.rounds else None
        return self._reply(_rng(seed), planned.output_tokens if planned else None, [], length)

    def _planned_round(self, messages: Sequence[dict[str, Any]], script: SimScript | None) -> ScriptedRound | None:
        if script is None:
            return None
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        round_index = sum(1 for m in messages[last_user + 1 :] if m.get("role") == "assistant")
        if round_index < len(script.rounds):
            return script.rounds[round_index]
        return ScriptedRound()

    def _reply(
        self,
        rng: random.Random,
        output_tokens: int | None,
        calls: list[tuple[str, dict[str, Any]]],
        length: Length,
    ) -> Reply:
        # Unscripted tool calls come bare; a scripted length pads them with a preamble.
        default = 1 if calls else self.default_output_tokens
        total = max(output_tokens or default, length.min_tokens + 1)
        tool_calls = tuple(
            ToolCall(
                id=f"chatcmpl-tool-{rng.getrandbits(64):016x}", name=n, arguments=json.dumps(a, ensure_ascii=False)
            )
            for n, a in calls
        )
        call_text = "".join(render_tool_call(n, a) for n, a in calls)
        call_pieces = self.tokenizer.pieces(call_text)
        if length.ignore_eos:  # benchmarks: exactly max_tokens tokens, no EOS
            content_pieces = _words(rng, max(0, length.max_tokens - len(call_pieces)))
            pieces = content_pieces + call_pieces
            token_ids = [self.tokenizer.piece_id(p) for p in pieces]
        else:
            content_pieces = _words(rng, max(0, total - 1 - len(call_pieces)))
            pieces = content_pieces + call_pieces + [""]
            token_ids = [self.tokenizer.piece_id(p) for p in pieces[:-1]] + [EOS_ID]
        reply = Reply(content="".join(content_pieces), tool_calls=tool_calls, token_ids=token_ids, pieces=pieces)
        return _cut_at_stop(reply, length.stop)


def _cut_at_stop(reply: Reply, stops: tuple[str, ...]) -> Reply:
    """End the reply at the first stop string, excluding it from the text (vLLM's default).

    Generation stops at the token that completes the stop string; that token's text
    is trimmed so the output ends right before the stop string.
    """
    text = reply.text
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return reply
    at, stop = min(found)
    pieces: list[str] = []
    offset = 0
    for piece in reply.pieces:
        end = offset + len(piece)
        pieces.append(piece[: max(0, at - offset)])
        offset = end
        if end >= at + len(stop):
            break
    content = reply.content[:at]
    calls = tuple(c for c in reply.tool_calls if text.find(c.arguments) + len(c.arguments) <= at)
    return Reply(content, calls, reply.token_ids[: len(pieces)], pieces, stop_reason=stop)


def _rng(seed: int | None) -> random.Random:
    """Seeded requests are reproducible; unseeded ones vary, as a sampling model's do
    (two sessions sending the same first request get different replies and tool-call ids)."""
    return random.Random(seed)


def _words(rng: random.Random, n: int) -> list[str]:
    """``n`` single-token pieces of text; the first has no leading space."""
    pieces: list[str] = []
    for i in range(n):
        if i % 13 == 12:
            pieces.append(".")
        else:
            word = rng.choice(_WORDS)
            pieces.append(word if i == 0 else " " + word)
    return pieces


def _default_tool(messages: Sequence[dict[str, Any]], offered: dict[str, Any], tool_choice: Any) -> str | None:
    if not offered or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        if name not in offered:
            raise ScriptError(f"tool_choice names {name!r}, which is not in tools")
        return name
    if tool_choice != "required" and messages and messages[-1].get("role") == "tool":
        return None  # a tool result is in: answer it
    return next(iter(offered))


def _arguments_for(schema: dict[str, Any], messages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Plausible arguments for a JSON schema: strings quote the last user message."""
    properties: dict[str, Any] = schema.get("properties") or {}
    names = schema.get("required") or list(properties)
    last_user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    text = " ".join(message_text(last_user.get("content")).split()[:8]) if last_user else ""
    return {name: _value_for(properties.get(name) or {}, text or "example") for name in names}


def _value_for(prop: dict[str, Any], text: str) -> Any:
    if prop.get("enum"):
        return prop["enum"][0]
    kind = prop.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return {"string": text, "integer": 1, "number": 1.0, "boolean": True, "array": [], "object": {}}.get(kind, text)
