"""Replay a trace against a live gateway as agent sessions would.

Each session starts at its arrival time (divided by the workers' speed-up), sends a
round, reads the streamed reply, waits its tool latency, answers with a message of the
trace's size, and sends the next round - the loop an agent framework runs. How a round
asks its engine for exactly the trace's work is the engines' :class:`Dialect`:

* the GPU-free engine (:class:`SimDialect`): its ``sim_script`` makes each round's output
  length and tool call the trace's, and its word-level tokenizer makes an n-word text n
  tokens, so the answer is a tool message;
* vLLM serving a byte-level test model (:class:`VllmDialect`, workers.vllm.tiny_model):
  ``max_tokens`` with ``ignore_eos`` makes the output length the trace's, and sampling
  only among letters and the space (``allowed_token_ids``) makes the reply text the
  tokens it was generated as, so the next round's prompt extends the last one's prompt
  and output exactly, as an agent's conversation does; an n-letter text is n tokens.
  Random weights call no tools, so the answer is a user message;
* the GPU-free engine behind routers that must see nothing of ours (:class:`LengthDialect`):
  ``max_tokens`` with ``ignore_eos`` - fields every OpenAI-compatible router forwards - make
  the output length the trace's; no tools, so every delta is one token and a client times
  each gap between tokens; the answer is a user message.

A session of an agent population (``TraceSession.prefix``) opens with its shared prefix as
a system message: each segment's text is fixed by its key (``Dialect.shared``), so every
session of the agent, in any run, sends the same leading tokens, and an engine that holds
them computes only the rest.
"""

from __future__ import annotations

import asyncio
import random
import re
import string
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import aiohttp
import orjson

from perfmodel.slo import Gaps, ItlRule
from planner.trace import TraceSession

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


@dataclass(frozen=True)
class LiveRound:
    session_id: str
    round: int
    ttft_s: float  # wall clock, from sending the request to the first token
    mean_itl_s: float | None  # over the engine's tokens
    p95_itl_s: float | None  # over the gaps between the deltas it streamed (see with_gateway_tails)
    max_itl_s: float | None
    tokens: int  # completion tokens (EOS included)
    gaps: tuple[float, ...] = ()  # between the deltas it streamed, as the client received them

    def itl(self, rule: ItlRule) -> float | None:
        return {"mean": self.mean_itl_s, "p95": self.p95_itl_s, "max": self.max_itl_s}[rule]


def words(session: int, round_index: int, n: int) -> str:
    """``n`` tokens of text unique to the session (one word = one token for the sim tokenizer)."""
    return " ".join(f"s{session}r{round_index}w{i}" for i in range(n))


class Dialect(Protocol):
    """How a round asks its engine for the trace's work."""

    def text(self, session: int, round_index: int, n: int) -> str:
        """``n`` tokens of text unique to the session's round."""
        ...

    def shared(self, key: str, n: int) -> str:
        """``n`` tokens of text fixed by ``key``: a shared prefix segment's."""
        ...

    def body(self, messages: list[dict], session: TraceSession, round_index: int) -> dict:
        """The round's chat request (streamed, with usage)."""
        ...

    def answer(self, reply: dict, text: str) -> list[dict]:
        """The messages that answer the reply with the next round's input."""
        ...


def shared_words(key: str, n: int) -> str:
    """``n`` tokens of text fixed by ``key`` (one word = one token for the sim tokenizer)."""
    stem = re.sub(r"[^a-z0-9]", "", key.lower()) or "p"
    return " ".join(f"{stem}w{i}" for i in range(n))


class SimDialect:
    """The GPU-free engine's: a scripted reply and a tool result (module docstring)."""

    def text(self, session: int, round_index: int, n: int) -> str:
        return words(session, round_index, n)

    def shared(self, key: str, n: int) -> str:
        return shared_words(key, n)

    def body(self, messages: list[dict], session: TraceSession, round_index: int) -> dict:
        return {"messages": messages, "tools": [TOOL], "stream": True, "sim_script": _script(session),
                "stream_options": {"include_usage": True}}  # fmt: skip

    def answer(self, reply: dict, text: str) -> list[dict]:
        return [{"role": "tool", "tool_call_id": call["id"], "content": text}
                for call in reply.get("tool_calls") or [{"id": "none"}]]  # fmt: skip


@dataclass(frozen=True)
class VllmDialect:
    """vLLM's, on a byte-level test model (module docstring). ``letters``: the ids of the
    lowercase letters and the space, which replies are sampled from; ``salt`` makes one
    run's texts unlike another's, so no run finds the last one's prefixes cached."""

    letters: tuple[int, ...]
    salt: str = ""

    def text(self, session: int, round_index: int, n: int) -> str:
        return self._letters(f"{self.salt}:{session}:{round_index}", n)

    def shared(self, key: str, n: int) -> str:
        return self._letters(f"{self.salt}:shared:{zlib.crc32(key.encode())}", n)

    @staticmethod
    def _letters(seed: str, n: int) -> str:
        rng = random.Random(seed)
        return "".join(" " if i % 6 == 5 else rng.choice(string.ascii_lowercase) for i in range(n))

    def body(self, messages: list[dict], session: TraceSession, round_index: int) -> dict:
        return {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": session.rounds[round_index].output_tokens, "ignore_eos": True,
                "allowed_token_ids": list(self.letters)}  # fmt: skip

    def answer(self, reply: dict, text: str) -> list[dict]:
        return [{"role": "user", "content": text}]


@dataclass(frozen=True)
class LengthDialect:
    """The GPU-free engine's, asked only in fields any OpenAI-compatible router forwards
    (module docstring): the trace's output length by ``max_tokens`` and ``ignore_eos``."""

    model: str

    def text(self, session: int, round_index: int, n: int) -> str:
        return words(session, round_index, n)

    def shared(self, key: str, n: int) -> str:
        return shared_words(key, n)

    def body(self, messages: list[dict], session: TraceSession, round_index: int) -> dict:
        return {"model": self.model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": session.rounds[round_index].output_tokens, "ignore_eos": True}  # fmt: skip

    def answer(self, reply: dict, text: str) -> list[dict]:
        return [{"role": "user", "content": text}]


def opening(dialect: Dialect, index: int, session: TraceSession) -> list[dict]:
    """The first round's messages: the shared prefix (a system message of its segments'
    texts) and then the session's own text, the trace's tokens between them."""
    first = session.rounds[0].input_tokens
    if not session.prefix:
        return [{"role": "user", "content": dialect.text(index, 0, first)}]
    system = " ".join(dialect.shared(segment.key, segment.tokens) for segment in session.prefix)
    own = dialect.text(index, 0, max(1, first - session.prefix_tokens))
    return [{"role": "system", "content": system}, {"role": "user", "content": own}]


def _script(session: TraceSession) -> dict:
    return {
        "rounds": [
            {"output_tokens": r.output_tokens, "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}
            if r.tool_calls
            else {"output_tokens": r.output_tokens}
            for r in session.rounds
        ]
    }


@dataclass(frozen=True)
class Streamed:
    message: dict  # the assistant turn, as the conversation continues with it
    sent: float
    first_token: float | None  # first content or tool-call delta
    finished: float | None  # the chunk carrying finish_reason: the last token's arrival
    completion_tokens: int  # the engine's count (usage), EOS included
    gaps: tuple[float, ...]  # between the deltas that carried content or a tool call, and the finish


def agent_client(connections: int) -> aiohttp.ClientSession:
    """The HTTP client of many concurrent agents. aiohttp rather than httpx for the reason
    the gateway's EngineClient gives: at hundreds of open streams httpx's pool made the
    load generator, not the system under test, the bottleneck. Idle connections are
    dropped after 4 s, before uvicorn's 5 s keep-alive closes them from its side - a
    request sent on a connection the server is closing at that moment would fail."""
    connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=4.0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0))


async def stream_round(client: aiohttp.ClientSession, url: str, body: dict, session_id: str) -> Streamed:
    """One streamed chat completion; RuntimeError for a non-200 answer or an error event."""
    content, calls, stamps, finished, tokens = "", {}, [], None, 0
    sent = time.perf_counter()
    async with client.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": session_id}) as response:
        if response.status != 200:
            raise RuntimeError(f"round of {session_id}: {response.status} {(await response.read())[:300]!r}")
        async for raw in response.content:
            if not raw.startswith(b"data: {"):
                continue
            chunk = orjson.loads(raw[6:])
            if "error" in chunk:
                raise RuntimeError(f"round of {session_id}: {chunk['error']}")
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason"):
                    finished = time.perf_counter()
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    content += delta["content"]
                    stamps.append(time.perf_counter())
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], {"id": "", "type": "function",
                                                             "function": {"name": "", "arguments": ""}})  # fmt: skip
                    entry["id"] = call.get("id") or entry["id"]
                    function = call.get("function") or {}
                    entry["function"]["name"] += function.get("name") or ""
                    entry["function"]["arguments"] += function.get("arguments") or ""
                    stamps.append(time.perf_counter())
    message: dict = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if finished is not None and stamps and finished > stamps[-1]:
        stamps.append(finished)
    gaps = tuple(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return Streamed(message, sent, stamps[0] if stamps else None, finished, tokens, gaps)


async def _session(
    client: aiohttp.ClientSession,
    url: str,
    index: int,
    session: TraceSession,
    speed: float,
    start: float,
    on_round: Callable[[LiveRound], None],
    dialect: Dialect,
) -> list[LiveRound]:
    await asyncio.sleep(max(0.0, start + session.arrival_s / speed - time.perf_counter()))
    messages = opening(dialect, index, session)
    out: list[LiveRound] = []
    for k, spec in enumerate(session.rounds):
        got = await stream_round(client, url, dialect.body(messages, session, k), session.session_id)
        if got.first_token is None or got.finished is None:
            raise RuntimeError(f"round {k} of {session.session_id} streamed no tokens")
        # Per token, as the gateway and the simulator count it: the engine's tokens, not the
        # SSE chunks (a tool call's tokens may arrive as fewer deltas).
        gaps = got.completion_tokens - 1
        itl = (got.finished - got.first_token) / gaps if gaps > 0 else None
        ttft = got.first_token - got.sent
        tail = Gaps.of(got.gaps)
        out.append(LiveRound(session.session_id, k, ttft, itl, tail.p95_s, tail.max_s, got.completion_tokens, got.gaps))
        on_round(out[-1])
        message = got.message
        messages = [*messages, message]
        if k + 1 == len(session.rounds):
            break
        await asyncio.sleep(spec.tool_latency_s / speed)
        messages += dialect.answer(message, dialect.text(index, k + 1, session.rounds[k + 1].input_tokens))
    return out


async def replay_sessions(
    url: str,
    sessions: Sequence[TraceSession],
    speed: float,
    on_round: Callable[[LiveRound], None] = lambda _: None,
    dialect: Dialect | None = None,
    tolerate: bool = True,
) -> tuple[list[LiveRound], dict[str, str]]:
    """Every session of the trace against the gateway at ``url``, asked in the engines'
    ``dialect`` (the GPU-free engine's by default); ``on_round`` hears of each round as it
    completes (a progress bar). The rounds completed, and each failed session's error by
    its id: with ``tolerate``, a session whose round fails stops there and the others go
    on; without, the first failure is raised."""
    dialect = dialect or SimDialect()
    done: list[LiveRound] = []

    def heard(r: LiveRound) -> None:
        done.append(r)
        on_round(r)

    async with agent_client(len(sessions) + 8) as client:
        start = time.perf_counter() + 0.5
        first = min(s.arrival_s for s in sessions)
        shifted = [s.model_copy(update={"arrival_s": s.arrival_s - first}) for s in sessions]
        runs = (_session(client, url, i, s, speed, start, heard, dialect) for i, s in enumerate(shifted))
        results = await asyncio.gather(*runs, return_exceptions=tolerate)
    failures = {s.session_id: f"{type(r).__name__}: {r}"[:300] for s, r in zip(sessions, results, strict=True)
                if isinstance(r, BaseException)}  # fmt: skip
    order = {s.session_id: i for i, s in enumerate(sessions)}
    return sorted(done, key=lambda r: (order[r.session_id], r.round)), failures


Tails = dict[tuple[str, int], tuple[float | None, float | None]]  # (session, round) -> (P95 gap, longest gap)


async def read_back(url: str, sessions: Sequence[TraceSession]) -> tuple[int, int, int, Tails]:
    """(rounds lost, rounds duplicated, rounds split between two engines, each recorded
    round's P95 and longest gap): every session's rounds as the gateway recorded them
    (``GET /v1/sessions/{id}``) against the trace's."""
    lost = duplicated = split = 0
    tails: Tails = {}
    async with agent_client(16) as client:
        for session in sessions:
            async with client.get(f"{url}/v1/sessions/{session.session_id}") as response:
                records = (await response.json())["rounds"] if response.status == 200 else []
            lost += max(0, len(session.rounds) - len(records))
            duplicated += max(0, len(records) - len(session.rounds))
            split += sum(r["split_at"] is not None for r in records)
            tails |= {(session.session_id, k): (r["p95_itl_s"], r["max_itl_s"]) for k, r in enumerate(records)}
    return lost, duplicated, split, tails


def with_gateway_tails(rounds: Sequence[LiveRound], tails: Tails) -> list[LiveRound]:
    """The rounds with their P95 and longest gap as the gateway timed them, per token.
    A client sees deltas, and vLLM's tool parser (which the GPU-free engine copies)
    streams several tokens of a tool call as one delta, so per delta the tail rules
    would judge stalls no engine step caused; the gateway spreads each delta's gap over
    the tokens it brought, as the simulator counts them."""
    out = []
    for r in rounds:
        p95, longest = tails.get((r.session_id, r.round), (r.p95_itl_s, r.max_itl_s))
        out.append(replace(r, p95_itl_s=p95, max_itl_s=longest))
    return out
