"""The least a gateway on ampd's Python stack does: relay a chat completion's bytes.

`ampd bench overhead`'s arm ``relay``. A raw ASGI app served as the gateway is served
(uvicorn with its uvloop event loop and httptools parser, no access log) forwards
``POST /v1/chat/completions`` to one engine over the gateway's own engine connections
(gateway.engines.connections) and passes the response on, status, content type and body
bytes, as they arrive: no parsing, no sessions, no Redis, no routing, no metrics. In one
run of the benchmark, ampd's CPU per request over this arm's is what ampd's own work
costs; this arm's over vllm-router's, what the Python stack itself costs.

    python -m bench.relay --port 8100 --upstream http://127.0.0.1:8001
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Annotated, Any

import orjson
import typer
import uvicorn

from gateway.apis.app import CHAT_PATH
from gateway.engines.connections import EngineConnections, Lost

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
_JSON = {"Content-Type": "application/json"}


def relay_argv(port: int, upstream: str) -> list[str]:
    """The command that serves the relay on ``port`` in front of ``upstream``, in this interpreter."""
    return [sys.executable, "-m", "bench.relay", "--port", str(port), "--upstream", upstream]


def relay_app(upstream: str) -> App:
    """The relay's ASGI app: ``GET /health`` and ``POST /v1/chat/completions`` (to
    ``upstream``); anything else is a 404. An engine that cannot be reached is a 502."""
    connections = EngineConnections(keepalive_s=4.0, connect_timeout_s=5.0, timeout_s=600.0)

    async def app(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["method"] == "GET" and scope["path"] == "/health":
            await _answer(send, 200, b"{}")
            return
        if scope["method"] != "POST" or scope["path"] != CHAT_PATH:
            await _answer(send, 404, b'{"error": {"message": "not found"}}')
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            streamed = orjson.loads(body).get("stream") is True
        except (orjson.JSONDecodeError, AttributeError):
            streamed = False  # the engine answers what is wrong with it
        kind = b"text/event-stream" if streamed else b"application/json"
        started = False
        try:
            async with connections.request("POST", upstream + CHAT_PATH, bytes(body), _JSON) as response:
                await send({"type": "http.response.start", "status": response.status,
                            "headers": [(b"content-type", kind)]})  # fmt: skip
                started = True
                async for data in response.body():
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except Lost as exc:
            if started:  # the status line is out: the body just ends short
                await send({"type": "http.response.body", "body": b""})
            else:
                await _answer(send, 502, orjson.dumps({"error": {"message": f"{upstream} unreachable: {exc}"}}))

    return app


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def main(
    upstream: Annotated[str, typer.Option(help="the engine's base URL, http://host:port")],
    port: Annotated[int, typer.Option()] = 8100,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
) -> None:
    # No lifespan: the relay keeps nothing that needs closing but its sockets, which go with the process.
    uvicorn.run(relay_app(upstream), host=host, port=port, log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    typer.run(main)
