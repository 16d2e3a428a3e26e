"""Talking to engines: vLLM's HTTP surface, the same for GPU-free and vLLM workers.

* ``tokenize``: prompt token count of a chat request (``POST /tokenize``);
* ``prefill``: the first half of vLLM's disaggregated hand-off - the prompt on a
  prefill worker with ``do_remote_decode`` and ``max_tokens: 1``, returning the
  ``kv_transfer_params`` the decode worker needs;
* ``stream``: a chat completion streamed from the decode worker (locally prefilled, or
  pulling the prefill's KV), measured as it passes: first-token time, inter-token
  gaps, usage, and the reply assembled for non-streaming clients;
* ``load``: KV usage and queue lengths scraped from ``/metrics``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.engines.connections import EngineConnections, Lost, TimedOut
from surface.wire import WorkerLoad, parse_load, prefill_params

KEEPALIVE_S = 4.0  # below uvicorn's default timeout_keep_alive of 5 s
CONNECT_TIMEOUT_S = 5.0


class UpstreamError(Exception):
    """A worker failed or answered with an error; ``status``/``body`` are its answer, if any.
    ``lost``: the connection itself failed (the worker died or hung), not the request."""

    def __init__(self, message: str, status: int = 502, body: dict[str, Any] | None = None, lost: bool = False) -> None:
        super().__init__(message)
        self.status, self.body, self.lost = status, body, lost


@dataclass
class Reply:
    """What a streamed completion amounted to, built chunk by chunk."""

    started: float  # when the round's TTFT clock started
    first_token_at: float | None = None
    last_token_at: float | None = None
    itl: list[float] = field(default_factory=list)  # every inter-token gap, in order
    completion_tokens: int = 0  # as the engine's per-chunk usage last counted them
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string (or token id) that ended the reply
    usage: dict[str, Any] | None = None
    head: dict[str, Any] | None = None  # id, created, model of the first chunk

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def observe(self, chunk: dict[str, Any], now: float) -> bool:
        """Take one chunk into account; False for the usage-only chunk, True otherwise.

        A chunk may carry several tokens: vLLM's tool parser sends nothing for the
        ``<tool_call>`` tag or the JSON around a function's name, and releases them with a
        later token. Where the engine counts tokens in every chunk (``stream_options.
        continuous_usage_stats``, which the gateway asks for), the time since the last
        chunk is spread evenly over the tokens it brought, so the gaps are per token - as
        the SLO's ITL and the simulator count them - and not per chunk. A chunk without
        that count is one token."""
        if self.head is None:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        usage, choices = chunk.get("usage"), chunk.get("choices")
        if usage is not None and not choices:
            self.usage = usage
            return False
        tokens = 1
        if usage is not None:
            tokens = usage["completion_tokens"] - self.completion_tokens
            self.completion_tokens = usage["completion_tokens"]
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at = now
        elif tokens > 0:
            self.itl += [(now - (self.last_token_at or now)) / tokens] * tokens
            self.last_token_at = now
        for choice in choices or ():
            delta = choice.get("delta") or {}
            self.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                self._merge_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        return True

    def _merge_call(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", 0)
        while len(self.tool_calls) <= index:
            self.tool_calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = self.tool_calls[index]
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def completion(self) -> dict[str, Any]:
        """An OpenAI ``chat.completion`` for a client that did not ask to stream."""
        head = self.head or {}
        choice = {"index": 0, "message": self.message(), "logprobs": None, "finish_reason": self.finish_reason}
        return {
            "id": head.get("id"),
            "object": "chat.completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [choice],
            "usage": self.usage,
        }


class EngineClient:
    """Every call to an engine, over the gateway's own kept-alive connections
    (gateway.engines.connections): aiohttp's client delayed the decode stream's first
    byte and took a large share of the gateway's CPU under load, and httpx's pool before
    it scanned every connection (with a readability check each) on every request
    (docs/studies/overhead.md)."""

    def __init__(self, timeout_s: float) -> None:
        self.connections = EngineConnections(KEEPALIVE_S, CONNECT_TIMEOUT_S, timeout_s)

    async def close(self) -> None:
        await self.connections.close()

    async def tokenize(
        self, url: str, model: str, messages: list[Any], tools: list[Any] | None, continue_final_message: bool = False
    ) -> int:
        body: dict[str, Any] = {"model": model, "messages": messages}
        if continue_final_message:  # the prompt of a continued message (gateway.engines.migration)
            body.update(add_generation_prompt=False, continue_final_message=True)
        if tools:
            body["tools"] = tools
        return int((await self._post(f"{url}/tokenize", body))["count"])

    async def prefill(
        self, url: str, body: dict[str, Any], request_id: str, split_at: int | None = None
    ) -> dict[str, Any]:
        """Prefill on a prefill worker - the prompt, or its first ``split_at`` tokens
        (rounds.split_point) - and return the kv_transfer_params for the decoder."""
        prefill_body = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        prefill_body.update(stream=False, max_tokens=1, kv_transfer_params=prefill_params(split_at))
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        params = (await self._post(f"{url}/v1/chat/completions", prefill_body, request_id)).get("kv_transfer_params")
        if not params:
            raise UpstreamError(f"{url} returned no kv_transfer_params")
        return params

    async def stream(
        self,
        url: str,
        body: dict[str, Any],
        request_id: str,
        reply: Reply,
        keep_usage: bool,
        transform: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> AsyncIterator[bytes]:
        """Stream a chat completion from a worker; yields the SSE bytes to relay (every
        event that arrived in one read, together) and fills ``reply`` as they pass.
        The usage chunk the gateway always asks for is relayed only if ``keep_usage``, and
        the per-chunk counts it asks for (see :meth:`Reply.observe`) never; with a
        ``transform``, each chunk is relayed as it rewrites it (or dropped)."""
        options = {"include_usage": True, "continuous_usage_stats": True}
        upstream_body = dict(body, stream=True, stream_options=options)
        headers, sent = {"X-Request-Id": request_id, **_JSON}, _json(upstream_body)
        try:
            async with self.connections.request("POST", f"{url}/v1/chat/completions", sent, headers) as r:
                if r.status != 200:
                    raise _error_in(url, r.status, await r.read())
                pending = b""
                async for data in r.body():
                    now = time.time()
                    *events, pending = (pending + data).split(b"\n\n")
                    relay = []
                    for event in events:
                        if not event.startswith(b"data: "):
                            continue
                        payload = event[6:]
                        if payload == b"[DONE]":
                            break
                        chunk = orjson.loads(payload)
                        if "error" in chunk:
                            message = chunk["error"].get("message")
                            raise UpstreamError(f"{url} failed mid-stream: {message}", 502, chunk)
                        content = reply.observe(chunk, now)
                        # The client asked for no per-chunk counts: re-encode only a chunk that has them.
                        counted = content and chunk.pop("usage", None) is not None
                        if transform is not None:
                            rewritten = transform(chunk)
                            if rewritten is not None:
                                relay.append(b"data: " + orjson.dumps(rewritten) + b"\n\n")
                        elif counted:
                            relay.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
                        elif content or keep_usage:
                            relay.append(event + b"\n\n")
                    if relay:
                        yield b"".join(relay)
        except Lost as exc:
            raise UpstreamError(f"{url} unreachable: {exc}", lost=True) from exc

    async def load(self, url: str) -> WorkerLoad:
        return parse_load(await self._get(f"{url}/metrics", 2.0))

    async def model(self, url: str) -> str:
        return json.loads(await self._get(f"{url}/v1/models", 5.0))["data"][0]["id"]

    async def _get(self, url: str, timeout_s: float) -> str:
        try:
            async with self.connections.request("GET", url, timeout_s=timeout_s) as r:
                body = await r.read()
        except TimedOut as exc:  # it answers, but slowly: busy, not lost
            raise UpstreamError(f"{url} did not answer within {timeout_s:g} s") from exc
        except Lost as exc:
            raise UpstreamError(f"{url} unreachable: {exc}", lost=True) from exc
        if r.status != 200:
            raise _error_in(url, r.status, body)
        return body.decode()

    async def _post(self, url: str, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        """POST and return the JSON answer."""
        headers = {"X-Request-Id": request_id, **_JSON} if request_id else _JSON
        try:
            async with self.connections.request("POST", url, _json(body), headers) as r:
                answer = await r.read()
        except Lost as exc:
            raise UpstreamError(f"{url} unreachable: {exc}", lost=True) from exc
        if r.status != 200:
            raise _error_in(url, r.status, answer)
        return orjson.loads(answer)


_JSON = {"Content-Type": "application/json"}


def _json(body: dict[str, Any]) -> bytes:
    """A request body for an engine. orjson, not aiohttp's ``json=`` (the standard library):
    a later round's body carries the session's whole conversation, which the standard
    library writes an order of magnitude slower. The gateway's request parsing admits no
    NaN or infinity, so both write the same values; an integer past 64 bits, which orjson
    refuses, goes the standard library's way."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        return json.dumps(body).encode()


def _error_in(url: str, status: int, raw: bytes) -> UpstreamError:
    """An engine's error answer: its status, and its JSON body where it has one."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    return UpstreamError(f"{url} answered {status}", status, body if isinstance(body, dict) else None)
