"""Counting a prompt's tokens in the gateway, with the engine's own code, where it can.

Every round needs its prompt's length (l_total, Eq. 1-2) before it is routed. Asking the
engine (``POST /tokenize``) puts an HTTP round trip on the critical path of every
round and spends the engine's CPU on it - the GPU-free engine runs on one core, so at
a few hundred streams every ``/tokenize`` is a token it does not generate. For the
GPU-free engine the gateway runs the engine's own tokenizer path instead: its request
model (workers.sim.protocol), its chat template and its tokenizer (workers.sim.tokenizer),
the three steps its ``/tokenize`` takes, so the count is the engine's by construction
(tests/test_gateway.py checks it against ``/tokenize``). For a vLLM engine it runs the
served model's tokenizer and chat template as vLLM applies them (gateway.model_tokenizer),
with the files the engine's supervisor published in Redis (:class:`ServedTokenizers`),
and checks a sample of its counts against the engine's. A model with no files published,
or one whose count ever differed, is counted by its engine's ``/tokenize``.

The count is made per message and remembered by the message's digest: the engine's
template renders each message on its own between special tokens, which its tokenizer
splits on first, so a prompt's count is the sum of its messages' (and its tools') plus
the fixed start and generation prompt (workers.sim.tokenizer: compositional at message
boundaries). A session's next round then validates, renders and tokenizes only what is
new, not its whole history again.

An engine is known by what its ``GET /version`` says, asked once when the pool first
sees it (gateway.pool).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError

from gateway.metrics import Family
from gateway.model_tokenizer import ModelTokenizer
from gateway.remembered import Remembered
from gateway.upstream import EngineClient, UpstreamError
from workers.registry import tokenizer_key
from workers.sim.protocol import SYSTEM_FINGERPRINT_PREFIX, EngineError, Message, Tool, message_dicts
from workers.sim.tokenizer import Tokenizer, render_chat

log = logging.getLogger(__name__)

SIM_ENGINE = "ampd-sim"  # what the pool calls an engine whose count the gateway can make itself
# Pieces do not depend on the vocabulary (ids do, and are not needed): any size will do.
_TOKENIZER = Tokenizer(vocab_size=1 << 16)


def _pieces(text: str) -> int:
    return len(_TOKENIZER.pieces(text))


_FRAME = _pieces(render_chat([], None))  # the start of text and the generation prompt
_START = _pieces(render_chat([], None, add_generation_prompt=False))


def _message(raw: dict[str, Any]) -> int:
    """One message's tokens as the engine renders it; raises where the engine refuses it."""
    return _pieces(render_chat(message_dicts([Message.model_validate(raw)]), None, False)) - _START


def _tools(raw: list[dict[str, Any]]) -> int:
    """The tools block's tokens; raises where the engine refuses the tools."""
    tools = [Tool.model_validate(t).model_dump(exclude_none=True) for t in raw]
    return _pieces(render_chat([], tools, False)) - _START


def _refused_as_none(count: Callable[[Any], int]) -> Callable[[Any], int | None]:
    """``count``, giving None for what the engine refuses."""

    def counted(item: Any) -> int | None:
        try:
            return count(item)
        except (ValidationError, ValueError, EngineError):
            return None

    return counted


# Counts by the digest of what was counted (a digest and an int each); None for what the engine refuses.
_MESSAGE, _TOOLS = Remembered(_refused_as_none(_message)), Remembered(_refused_as_none(_tools))


def engine_kind(version: dict[str, Any]) -> str | None:
    """The tokenizer the gateway can run for an engine, from its ``/version`` answer; None
    when it has to ask the engine."""
    return SIM_ENGINE if str(version.get("version", "")).startswith(SYSTEM_FINGERPRINT_PREFIX) else None


def sim_prompt_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int | None:
    """The GPU-free engine's ``/tokenize`` count of a chat prompt, or None where the engine
    would refuse it: the caller then asks the engine, whose answer (the error, in its words)
    is the one the client must get."""
    if not messages:  # the engine's 400 (workers.sim.protocol.message_dicts)
        return None
    total = _FRAME
    for counted in (_TOOLS(tools) if tools else 0, *map(_MESSAGE, messages)):
        if counted is None:
            return None
        total += counted
    return total


class ServedTokenizers:
    """The vLLM-served models' tokenizers (gateway.model_tokenizer), loaded from Redis on
    a model's first round, off its path: until one is loaded, and for a model whose
    supervisor published no files (looked for again every ``RETRY_S``), ``count`` gives
    None and the engine is asked."""

    RETRY_S = 30.0

    def __init__(self, redis: aioredis.Redis, prefix: str, client: EngineClient, checks: Family) -> None:
        self.redis, self.prefix, self.client, self.checks = redis, prefix, client, checks
        self._models: dict[str, ModelTokenizer] = {}
        self._looked_at: dict[str, float] = {}
        self._distrusted: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def count(
        self, model: str, url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> int | None:
        """The prompt's count for the engine at ``url``, or None where the engine must be asked."""
        tokenizer = self._models.get(model)
        if tokenizer is None:
            self._load_later(model)
            return None
        counted = tokenizer.count(messages, tools)
        if counted is not None and tokenizer.checking():
            self._spawn(self._check(model, url, messages, tools, counted))
        return counted

    def _load_later(self, model: str) -> None:
        if model in self._distrusted or time.monotonic() - self._looked_at.get(model, -self.RETRY_S) < self.RETRY_S:
            return
        self._looked_at[model] = time.monotonic()
        self._spawn(self._load(model))

    async def _load(self, model: str) -> None:
        try:
            raw = await self.redis.get(tokenizer_key(self.prefix, model))
        except aioredis.RedisError as exc:
            log.info("tokenizer files of %s not read (%r): its engines count its prompts", model, exc)
            return
        if raw is None:
            return
        try:  # a large tokenizer.json takes a while to build: not on the event loop
            self._models[model] = await asyncio.to_thread(ModelTokenizer, json.loads(raw))
        except Exception as exc:  # Unsupported, bad JSON, or what tokenizers and Jinja raise for bad files
            log.warning("cannot count %s's prompts in the gateway (%s): its engines count them", model, exc)
            self._distrusted.add(model)

    async def _check(
        self, model: str, url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, counted: int
    ) -> None:
        try:
            engines = await self.client.tokenize(url, model, messages, tools)
        except UpstreamError:
            return  # no answer to compare with; a later round is checked
        if engines == counted:
            self.checks.labels("equal").inc()
            return
        self.checks.labels("differs").inc()
        if model not in self._distrusted:
            log.warning("the gateway counted %d prompt tokens of %s where its engine counts %d: "
                        "its engines count its prompts from now on", counted, model, engines)  # fmt: skip
            self._distrusted.add(model)
            self._models.pop(model, None)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
