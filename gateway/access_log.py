"""The access log: one JSON line a request, for an operator - when, which API, whose
session and round, where it ran, how it ended, how fast its first token came, how many
tokens. Never a prompt or a reply (those go to ``ampd.content``, with ``--log-content``).

:class:`AccessLog` wraps the gateway's whole ASGI app, the hot path included, so every
request is counted once, errors and all. The line is handed to a queue (logging's
QueueHandler) and written by a thread of its own (QueueListener), so a slow disk never
stalls the event loop. The file rotates by size (RotatingFileHandler). Rotation renames
the file, which only one process may do safely: a gateway of several processes writes
one file per process (:func:`per_process`).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import time
from datetime import UTC, datetime
from logging.handlers import QueueHandler, QueueListener, RotatingFileHandler
from pathlib import Path
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import GatewayConfig

log = logging.getLogger("ampd.access")
APIS = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}
OFF, STDERR = "off", "-"
EXCHANGE_FIELDS = ("tenant", "model", "session", "round", "route", "decode_worker", "ttft_s", "prompt_tokens",
                   "completion_tokens")  # fmt: skip


def per_process(setting: str) -> str:
    """The file one process of several writes: the pid before the suffix
    (``ampd-access.log`` -> ``ampd-access.<pid>.log``); stderr and off as they are."""
    if setting in (OFF, STDERR):
        return setting
    path = Path(setting)
    return str(path.with_name(f"{path.stem}.{os.getpid()}{path.suffix}"))


def open_access_log(config: GatewayConfig) -> QueueListener | None:
    """Start writing ``ampd.access`` where the configuration says; None when it is off.
    The caller stops the listener at shutdown, which writes what is still queued."""
    if config.access_log == OFF:
        return None
    if config.access_log == STDERR:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        handler = RotatingFileHandler(config.access_log, maxBytes=config.access_log_max_bytes,
                                      backupCount=config.access_log_backups, encoding="utf-8")  # fmt: skip
    lines: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    log.handlers = [QueueHandler(lines)]  # replaces any earlier app's in this process
    log.setLevel(logging.INFO)
    log.propagate = False
    listener = QueueListener(lines, handler)
    listener.start()
    return listener


class AccessLog:
    """ASGI middleware writing a request's access line once its response is over."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival, began = time.time(), time.perf_counter()
        status = 500  # what uvicorn answers if the app fails before it starts a response

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            line = entry(scope, status, arrival, time.perf_counter() - began)
            log.info(orjson.dumps(line).decode())


def entry(scope: Scope, status: int, arrival: float, duration_s: float) -> dict[str, Any]:
    """A request's access line: what the relay left in the request's state
    (gateway.apis.relay.Started, once an exchange opened) and how the response went."""
    path = scope["path"]
    line: dict[str, Any] = {
        "time": datetime.fromtimestamp(arrival, UTC).isoformat(timespec="milliseconds"),
        "api": next((api for prefix, api in APIS.items() if path.startswith(prefix)), None),
        "method": scope["method"], "path": path, "status": status, "duration_s": round(duration_s, 6),
    }  # fmt: skip
    started = scope.get("state", {}).get("exchange")
    if started is None:  # refused or failed before its exchange opened, or not an API request
        return line | dict.fromkeys(EXCHANGE_FIELDS)
    usage, ttft = started.client.usage or {}, started.client.ttft_s
    return line | {
        "tenant": started.ex.scope, "model": started.model, "session": started.ex.session.session_id,
        "round": started.round, "route": started.headers["X-AMPD-Route"],
        "decode_worker": started.headers["X-AMPD-Decode-Worker"], "ttft_s": None if ttft is None else round(ttft, 6),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens", started.client.completion_tokens),
    }  # fmt: skip
