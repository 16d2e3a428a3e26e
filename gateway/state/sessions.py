"""Sessions: who a request belongs to, and what the gateway remembers about it.

Identity, in order: a session header (``X-Session-Id`` first, then the headers agent
clients send on their own: see :func:`explicit_session_id`), else the body's
``prompt_cache_key``, ``user`` or ``metadata.session_id``, else inference from the
conversation itself.
After every round the gateway stores a hash of the whole conversation so far -
request messages plus the assistant's reply - under the session; a later request
whose message list starts with exactly that conversation continues the session. Only
whole conversations ending in a reply are stored, so two sessions that merely share
a system prompt (or any other prefix) are never merged. Every id and hash is scoped
to the caller's API key.

State lives in Redis with a TTL refreshed by every round, so bindings survive gateway
restarts and every replica sees the same session. Each replica also keeps its own copy
of the sessions it saved last, which it falls back on when Redis does not answer or no
longer has them (restarted empty): see gateway.state.outage.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

import redis.asyncio as aioredis

from gateway.remembered import Remembered
from gateway.state import scripts
from gateway.state.outage import REDIS_DOWN, RedisHealth
from rounds.core import SessionState

MAX_ROUND_RECORDS = 1000
RECENT_ROUNDS = 16  # records a retried request's round is looked for among (gateway.state.scripts.RECORD_ROUND)
HELD = 10_000  # sessions a replica keeps its own copy of (with transcripts and conversation keys)
ACTIVE_WINDOW_S = 300  # a session with an exchange this recent counts as active (agents wait on tools)


@dataclass
class Session:
    session_id: str
    scope: str
    state: SessionState  # where its KV is: the round core's part (rounds.core)
    created: float = 0.0
    explicit_id: bool = True
    conversation_len: int = 0  # messages in the conversation the client holds
    conversation_hash: str = ""  # conversation_hashes(...)[-1] of that conversation
    has_transcript: bool = False  # the engine holds more than the client sees (server tool rounds)
    trace_id: str = ""  # the session's span (gateway.tracing), parent of its rounds' spans
    span_id: str = ""

    def fields(self) -> dict[str, str]:
        """The session as the flat Redis hash ``load`` reads back."""
        flat = shallow(self) | shallow(self.state)
        del flat["state"]
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in flat.items()}


# Session headers, in the order they are taken (lower case, as the server sees them):
SESSION_HEADERS = (
    "x-session-id",  # ampd's own (OpenCode sends it too, per Dynamo's agent docs)
    "x-dynamo-session-id",  # NVIDIA Dynamo's canonical agent session header
    "x-claude-code-session-id",  # Claude Code: one id per CLI session
    "thread-id",  # Codex CLI (current): the conversation thread
    "session_id",  # Codex CLI (codex-rs build_conversation_headers): the conversation id
    "session-id",  # Codex CLI (releases Dynamo 1.3/1.4 map)
    "conversation_id",  # Codex CLI (older releases, alongside session_id)
)


def shallow(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, values as they are: ``dataclasses.asdict`` deep-copies
    every value, which for the records and sessions written every round is wasted work."""
    names, get = _fields_of(type(obj))
    return dict(zip(names, get(obj), strict=True))


@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """A dataclass's field names and one getter for them all: ``dataclasses.fields`` builds
    its answer anew on every call (40 Python calls a round for a session and its state)."""
    names = tuple(f.name for f in fields(cls))
    get = attrgetter(*names)
    return names, get if len(names) > 1 else lambda obj: (get(obj),)  # one name: no tuple


def explicit_session_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The session id a client gave, if any: the first of

    1. ``X-Session-Id`` (ampd's own header);
    2. ``X-Dynamo-Session-ID`` (NVIDIA Dynamo's agent header, for clients already set up for it);
    3. ``X-Claude-Code-Session-Id`` (sent by Claude Code on every request);
    4. Codex CLI's ``thread-id``, ``session_id``, ``session-id``, ``conversation_id`` headers;
    5. the body's ``prompt_cache_key`` (Codex sends its conversation id there too), ``user``,
       ``metadata.session_id`` (where /v1/messages puts Anthropic's ``metadata.user_id``
       and /v1/responses its ``conversation``).

    The OpenAI Agents SDK sends no session header: it chains responses by
    ``previous_response_id``, which /v1/responses resolves to the stored session before
    this is asked. Ids are scoped to the caller's API key by the session store, so two
    tenants giving the same id get two sessions."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value and value.strip():
            return value.strip()
    metadata = body.get("metadata")
    candidates = [
        body.get("prompt_cache_key"),
        body.get("user"),
        metadata.get("session_id") if isinstance(metadata, dict) else None,
    ]
    return next((str(c) for c in candidates if c), None)


# The canonical form is json.dumps(parts, sort_keys=True, separators=(",", ":")): conversation
# keys stored in Redis are hashes of it, so its bytes must not change. It is written here
# piece by piece with json's own string escaping because json.dumps builds an encoder on
# every call, which was most of the cost of hashing a long conversation on every round.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_STRING = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str


def _arguments(raw: Any) -> Any:
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def canonical_message(message: Mapping[str, Any]) -> str:
    """A message as the hash chain sees it: what clients may reformat does not count
    (null vs empty content, whitespace, JSON spacing of tool arguments)."""
    calls = [
        [
            c.get("id", ""),
            (c.get("function") or {}).get("name", ""),
            _arguments((c.get("function") or {}).get("arguments")),
        ]
        for c in message.get("tool_calls") or []
    ]
    role, text = message.get("role", ""), _text(message.get("content")).strip()
    call_id = message.get("tool_call_id") or ""
    if not (type(role) is str and type(call_id) is str):  # what validation let through otherwise: encoded whole
        return _CANONICAL.encode([role, text, calls, call_id])
    return f"[{_STRING(role)},{_STRING(text)},{_CANONICAL.encode(calls) if calls else '[]'},{_STRING(call_id)}]"


def _text(content: Any) -> str:
    """A message's ``content`` as text: a string, None, or the text strings of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(t for part in content if isinstance(part, dict) and isinstance(t := part.get("text"), str))


def conversation_hashes(scope: str, messages: Sequence[Mapping[str, Any]], after: str = "") -> list[str]:
    """hashes[i] identifies messages[: i + 1] - or, given ``after`` (the hash of the
    conversation before them), that conversation followed by messages[: i + 1]. A chain,
    so each costs one hash, and a conversation grown by a reply costs one more.

    Every round of a session sends its whole conversation again, so each link is
    remembered by the hash before it and the message as sent (``_LINK``): a round
    computes the canonical form of its new messages only, so a long session's rounds
    cost the gateway what its new messages cost, not what its history does."""
    out, state = [], after or hashlib.blake2b(scope.encode(), digest_size=16).hexdigest()
    for message in messages:
        state = _LINK((state, message))
        out.append(state)
    return out


def _link(pair: tuple[str, Mapping[str, Any]]) -> str:
    """The chain's next hash: the one before it and the message's canonical form."""
    before, message = pair
    return hashlib.blake2b(bytes.fromhex(before) + canonical_message(message).encode(), digest_size=16).hexdigest()


_LINK = Remembered(_link)


class SessionStore:
    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int, health: RedisHealth) -> None:
        self.redis, self.p, self.ttl_s, self.health = redis, prefix, ttl_s, health
        # Redis key -> what was last written there by this replica, newest last; kept as
        # written (flat strings), so the garbage collector has nothing in it to walk.
        self._held: OrderedDict[str, str | dict[str, str]] = OrderedDict()

    def _hold(self, key: str, value: str | dict[str, str]) -> None:
        self._held[key] = value
        self._held.move_to_end(key)
        while len(self._held) > 3 * HELD:
            self._held.popitem(last=False)

    def _key(self, scope: str, session_id: str) -> str:
        return f"{self.p}:session:{scope}:{session_id}"

    def _conversation(self, scope: str, digest: str) -> str:
        return f"{self.p}:conversation:{scope}:{digest}"

    async def load(self, scope: str, session_id: str) -> Session | None:
        try:
            fields = await self.redis.hgetall(self._key(scope, session_id))
        except REDIS_DOWN as exc:
            self.health.failed("session", exc)
            fields = {}
        return self.session(scope, session_id, fields)

    def session(self, scope: str, session_id: str, fields: Mapping[str, str]) -> Session | None:
        """The session from its Redis hash, or - where Redis has none (restarted empty, or
        away) - from this replica's copy of what it last wrote there."""
        fields = fields or self._held.get(self._key(scope, session_id)) or {}
        if not fields:
            return None
        state = SessionState(
            decode_worker=fields["decode_worker"],
            l_hist=int(fields["l_hist"]),
            prefill_worker=fields["prefill_worker"],
            prefill_cached=int(fields["prefill_cached"]),
            rounds=int(fields["rounds"]),
        )
        return Session(
            session_id=session_id,
            scope=scope,
            state=state,
            created=float(fields["created"]),
            explicit_id=fields["explicit_id"] == "1",
            conversation_len=int(fields["conversation_len"]),
            conversation_hash=fields["conversation_hash"],
            has_transcript=fields["has_transcript"] == "1",
            trace_id=fields.get("trace_id", ""),
            span_id=fields.get("span_id", ""),
        )

    # -- a round's reads, in one round trip (gateway.state.scripts.OPEN, run by gateway.state.round_reads) --
    def open_args(self, scope: str, explicit: str | None, hashes: Sequence[str]) -> tuple[list[str], list[str]]:
        """OPEN's keys (the conversation keys a session is inferred from, when the client
        gave no id) and its session arguments."""
        keys = [] if explicit else [self._conversation(scope, h) for h in hashes[:-1]]
        return keys, [self._key(scope, ""), self._transcript(scope, ""), explicit or ""]

    def infer(self, keys: Sequence[str], found: Sequence[str | None]) -> str | None:
        """The session whose stored conversation is the longest proper prefix of the
        request's messages: ``found`` holds the ids Redis has under ``keys`` (OPEN's
        conversation keys), each completed by this replica's copy where Redis has none."""
        ids = [sid or self._held.get(key) for sid, key in zip(found, keys, strict=True)]
        return next((str(sid) for sid in reversed(ids) if sid), None)

    def _transcript(self, scope: str, session_id: str) -> str:
        return f"{self.p}:transcript:{scope}:{session_id}"

    def save(
        self,
        pipe: aioredis.client.Pipeline,
        session: Session,
        conversation: Sequence[Mapping[str, Any]],
        conversation_hash: str,
        transcript: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Stage the session after an exchange on ``pipe``. ``conversation`` is what the
        client now holds (its messages and the reply it got), ``conversation_hash`` its
        last conversation_hashes entry; ``transcript``, when the engine saw more (server
        tool rounds), is the engine's conversation. Sessions without a client-given id
        become findable by their conversation."""
        session.conversation_len = len(conversation)
        session.conversation_hash = conversation_hash
        session.has_transcript = transcript is not None
        key = self._key(session.scope, session.session_id)
        flat = session.fields()
        self._hold(key, flat)
        transcript_key = self._transcript(session.scope, session.session_id)
        raw = ""
        if transcript is not None:
            raw = json.dumps(list(transcript))
            self._hold(transcript_key, raw)
        else:
            self._held.pop(transcript_key, None)
        keys = [key, transcript_key, f"{self.p}:active"]
        if not session.explicit_id:
            conversation_key = self._conversation(session.scope, session.conversation_hash)
            keys.append(conversation_key)
            self._hold(conversation_key, session.session_id)
        member = f"{session.scope}:{session.session_id}"
        pairs = [x for pair in flat.items() for x in pair]
        # EVAL, not EVALSHA: see record_round.
        pipe.eval(scripts.SAVE_SESSION, len(keys), *keys, self.ttl_s, raw, member, time.time(), session.session_id,
                  *pairs)  # fmt: skip

    async def active(self) -> int:
        """Sessions, across all replicas, with an exchange in the last ACTIVE_WINDOW_S."""
        key = f"{self.p}:active"
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(key, "-inf", time.time() - ACTIVE_WINDOW_S)
            pipe.zcard(key)
            return int((await pipe.execute())[1])

    def _rounds(self, scope: str, session_id: str) -> str:
        return f"{self.p}:rounds:{scope}:{session_id}"

    def record_round(
        self, pipe: aioredis.client.Pipeline, session: Session, record: Mapping[str, Any], request: str
    ) -> None:
        """Stage one round's record (route, queue wait, TTFT, ITL, ...) for ``GET /v1/sessions/{id}``;
        the newest MAX_ROUND_RECORDS are kept, as long as the session. ``request`` names the
        round (:func:`round_key`): a retried request's round replaces its earlier record."""
        key = self._rounds(session.scope, session.session_id)
        entry = json.dumps(dict(record, request=request))
        # EVAL, not a registered script's EVALSHA: a pipeline holding a registered script asks
        # Redis whether it has it (SCRIPT EXISTS) before every execute, a round trip more.
        pipe.eval(scripts.RECORD_ROUND, 1, key, entry, request, MAX_ROUND_RECORDS, self.ttl_s, RECENT_ROUNDS)

    async def rounds(self, scope: str, session_id: str) -> list[dict[str, Any]]:
        return [json.loads(r) for r in await self.redis.lrange(self._rounds(scope, session_id), 0, -1)]

    async def transcript(self, scope: str, session_id: str) -> list[dict[str, Any]] | None:
        try:
            raw = await self.redis.get(self._transcript(scope, session_id))
        except REDIS_DOWN as exc:
            self.health.failed("session", exc)
            raw = None
        return self.parse_transcript(scope, session_id, raw)

    def parse_transcript(self, scope: str, session_id: str, raw: str | None) -> list[dict[str, Any]] | None:
        """A session's transcript as Redis has it, else as this replica last wrote it."""
        raw = raw or self._held.get(self._transcript(scope, session_id))
        return None if raw is None else json.loads(str(raw))


def round_key(request_hash: str, index: int) -> str:
    """A round's idempotency key: the conversation the client sent (its last
    conversation_hashes entry, which covers every message and the API key's scope) and
    the round's place in that exchange (server tool rounds follow the first). A client
    retrying a request sends the same conversation, so its rounds get the same keys."""
    return f"{request_hash}:{index}"


def new_session(session_id: str, scope: str, state: SessionState, explicit_id: bool) -> Session:
    return Session(session_id, scope, state, created=time.time(), explicit_id=explicit_id)


def continues(session: Session, hashes: Sequence[str]) -> bool:
    """Whether a request (given its conversation_hashes) extends what the decode worker
    holds; if the client rewrote history, the cached KV no longer counts as l_hist."""
    n = session.conversation_len
    return n == 0 or (len(hashes) > n and hashes[n - 1] == session.conversation_hash)
