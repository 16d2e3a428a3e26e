"""What a client's round reads before the round core plans it, in one Redis round trip.

The round needs its session - by the id the client gave, else inferred from the
conversation (gateway.state.sessions) - with the session's transcript where server tool
rounds made one, and the load signals of every worker it could go to
(gateway.state.prefill_queue). One script reads them all (gateway.state.scripts.OPEN). Read one by
one, a continued session cost three round trips in a row (its conversation keys, then
the session, then its transcript) beside the signals' own, and on a loaded gateway each
round trip waits its turn in a busy event loop.

Where Redis is away, or no longer has what this replica wrote there last (it restarted
empty), the session comes from the replica's own copy (gateway.state.outage), as the session
store reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.state import scripts
from gateway.state.outage import REDIS_DOWN, RedisHealth
from gateway.state.prefill_queue import PrefillQueues
from gateway.state.redis_batch import RedisBatch
from gateway.state.sessions import Session, SessionStore
from gateway.state.stats import WindowedStats
from rounds.core import Signals, signal_series


@dataclass
class Opened:
    session: Session | None
    transcript: list[dict[str, Any]] | None  # the engine's conversation, where it differs from the client's
    signals: Signals


class RoundReads:
    def __init__(
        self,
        batch: RedisBatch,
        sessions: SessionStore,
        queues: PrefillQueues,
        stats: WindowedStats,
        health: RedisHealth,
    ) -> None:
        self.sessions, self.queues, self.stats, self.health = sessions, queues, stats, health
        self.batch = batch
        self._open = batch.redis.register_script(scripts.OPEN)

    async def read(self, scope: str, explicit: str | None, hashes: Sequence[str], worker_ids: list[str]) -> Opened:
        """The session (``explicit``: the id the client gave; else inferred from ``hashes``,
        the request's conversation_hashes) and the signals of ``worker_ids``."""
        wanted = signal_series(worker_ids)
        keys, args = self.sessions.open_args(scope, explicit, hashes)
        try:
            found, read_id, flat, raw, loads = await self.batch.script(
                self._open, keys, [*args, *self.queues.signals_args(worker_ids, self.stats, wanted)]
            )
        except REDIS_DOWN as exc:
            self.health.failed("session", exc)
            found, read_id, flat, raw, loads = [None] * len(keys), None, [], None, None
        signals = self.queues.parse_signals(worker_ids, self.stats, wanted, loads)
        session_id = explicit or self.sessions.infer(keys, found)
        if session_id is None:
            return Opened(None, None, signals)
        if read_id is not None and session_id != read_id:
            # Only this replica's copy names this session (Redis lost the conversation key):
            # what Redis may still have of it is read on its own.
            session = await self.sessions.load(scope, session_id)
            transcript = await self.sessions.transcript(scope, session_id) if _has(session) else None
        else:
            session = self.sessions.session(scope, session_id, dict(zip(flat[0::2], flat[1::2], strict=True)))
            transcript = self.sessions.parse_transcript(scope, session_id, raw) if _has(session) else None
        return Opened(session, transcript, signals)

    async def signals(self, worker_ids: list[str]) -> Signals:
        """The signals alone: a server tool round, whose session is in hand."""
        return await self.queues.signals(worker_ids, self.stats, signal_series(worker_ids))


def _has(session: Session | None) -> bool:
    """Whether the session has a transcript to read."""
    return session is not None and session.has_transcript
