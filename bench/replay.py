"""Replay a trace against a live gateway as agent sessions would.

Each session starts at its arrival time (divided by the workers' speed-up), sends a
round, reads the streamed reply, waits its tool latency, answers the tool call with a
tool message of the trace's size, and sends the next round - the loop an agent
framework runs. The GPU-free engine's ``sim_script`` makes each round's output length
and tool call exactly the trace's, and its word-level tokenizer makes an n-word text n
tokens, so the live run and planner.simulator see the same work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

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

    def itl(self, rule: ItlRule) -> float | None:
        return {"mean": self.mean_itl_s, "p95": self.p95_itl_s, "max": self.max_itl_s}[rule]


def words(session: int, round_index: int, n: int) -> str:
    """``n`` tokens of text unique to the session (one word = one token for the sim tokenizer)."""
    return " ".join(f"s{session}r{round_index}w{i}" for i in range(n))


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
    gaps: Gaps  # between the deltas that carried content or a tool call, and the finish


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
    gaps = Gaps.of([b - a for a, b in zip(stamps, stamps[1:], strict=False)])
    return Streamed(message, sent, stamps[0] if stamps else None, finished, tokens, gaps)


async def _session(
    client: aiohttp.ClientSession,
    url: str,
    index: int,
    session: TraceSession,
    speed: float,
    start: float,
    on_round: Callable[[LiveRound], None],
) -> list[LiveRound]:
    await asyncio.sleep(max(0.0, start + session.arrival_s / speed - time.perf_counter()))
    messages: list[dict] = [{"role": "user", "content": words(index, 0, session.rounds[0].input_tokens)}]
    script, out = _script(session), []
    for k, spec in enumerate(session.rounds):
        body = {"messages": messages, "tools": [TOOL], "stream": True, "sim_script": script,
                "stream_options": {"include_usage": True}}  # fmt: skip
        got = await stream_round(client, url, body, session.session_id)
        if got.first_token is None or got.finished is None:
            raise RuntimeError(f"round {k} of {session.session_id} streamed no tokens")
        # Per token, as the gateway and the simulator count it: the engine's tokens, not the
        # SSE chunks (a tool call's tokens may arrive as fewer deltas).
        gaps = got.completion_tokens - 1
        itl = (got.finished - got.first_token) / gaps if gaps > 0 else None
        ttft = got.first_token - got.sent
        out.append(LiveRound(session.session_id, k, ttft, itl, got.gaps.p95_s, got.gaps.max_s, got.completion_tokens))
        on_round(out[-1])
        message = got.message
        messages = [*messages, message]
        if k + 1 == len(session.rounds):
            break
        await asyncio.sleep(spec.tool_latency_s / speed)
        result = words(index, k + 1, session.rounds[k + 1].input_tokens)
        for call in message.get("tool_calls") or [{"id": "none"}]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return out


async def replay(
    url: str, sessions: Sequence[TraceSession], speed: float, on_round: Callable[[LiveRound], None] = lambda _: None
) -> list[LiveRound]:
    """Every session of the trace against the gateway at ``url``; ``on_round`` hears of each
    round as it completes (a progress bar)."""
    async with agent_client(len(sessions) + 8) as client:
        start = time.perf_counter() + 0.5
        first = min(s.arrival_s for s in sessions)
        shifted = [s.model_copy(update={"arrival_s": s.arrival_s - first}) for s in sessions]
        runs = (_session(client, url, i, s, speed, start, on_round) for i, s in enumerate(shifted))
        results = await asyncio.gather(*runs)
    return [r for rounds in results for r in rounds]


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
