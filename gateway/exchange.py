"""One client request - an exchange - as the gateway carries it through its rounds."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.state.sessions import Session
from perfmodel.slo import SLO
from rounds.core import Bound

log = logging.getLogger(__name__)
PUBLIC_SCOPE = "public"  # the one scope of a gateway without API keys


@dataclass
class Exchange:
    """One client request; several engine rounds when server-side tools run."""

    arrival: float
    scope: str
    body: dict[str, Any]  # the client's body, model resolved
    client_messages: list[dict[str, Any]]
    engine_messages: list[dict[str, Any]]  # what the engine sees: the session's transcript spliced in
    engine_tools: list[dict[str, Any]] | None  # the client's tools plus the enabled server tools
    server_tools: frozenset[str]
    session: Session
    slo: SLO
    wants_usage: bool
    rounds: list[dict[str, Any]] = field(default_factory=list)  # server tool rounds, for the client
    request_hash: str = ""  # conversation_hashes(...)[-1] of the client's messages: names its rounds
    writes: Any = None  # a Redis pipeline of a finished round's writes, sent with the exchange's own

    @property
    def streaming(self) -> bool:
        return bool(self.body.get("stream"))

    def engine_body(self) -> dict[str, Any]:
        body = {k: v for k, v in self.body.items() if k != "server_tools"}
        body["messages"] = self.engine_messages
        if self.engine_tools:
            body["tools"] = self.engine_tools
        if self.scope != PUBLIC_SCOPE:  # tenants share no prefix-cache block, so none can probe another's prompts
            salt = self.body.get("cache_salt")
            body["cache_salt"] = f"{self.scope}:{salt}" if salt else self.scope
        return body

    def rebound(self, bound: Bound) -> None:
        """The session after binding: one that moved starts its conversation over there."""
        session = self.session
        if bound.moved and session.state.rounds:
            log.info("session %s re-bound from %s to %s", session.session_id, session.state.decode_worker,
                     bound.state.decode_worker)  # fmt: skip
        if bound.moved:
            session.conversation_len = 0
        session.state = bound.state
