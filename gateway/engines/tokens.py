"""Counting a prompt's tokens in the gateway, with its engine's own tokenizer and template.

Every round needs its prompt's length (l_total, Eq. 1-2) before it is routed. Asking the
engine (``POST /tokenize``) puts an HTTP round trip on the critical path of every round
and spends the engine's CPU on it. So every engine - vLLM's supervisor and the GPU-free
engine alike - publishes its served model's tokenizer and chat template in Redis
(surface.registry.publish_tokenizer), and the gateway counts with them as vLLM applies
them (gateway.engines.model_tokenizer), checking a sample of its counts against the
engine's. A model with no files published, or one whose count ever differed, is counted
by its engine's ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import redis.asyncio as aioredis

from gateway.engines.model_tokenizer import Counted, ModelTokenizer
from gateway.engines.upstream import EngineClient, UpstreamError
from gateway.metrics import Family
from surface.registry import tokenizer_key

log = logging.getLogger(__name__)


class ServedTokenizers:
    """The served models' tokenizers (gateway.engines.model_tokenizer), loaded from Redis
    once the pool serves the model (or at its first round), off the rounds' path: until
    one is loaded, and for a model whose engines published no files (looked for again
    every ``RETRY_S``), ``count`` gives None and the engine is asked."""

    RETRY_S = 30.0

    def __init__(self, redis: aioredis.Redis, prefix: str, client: EngineClient, checks: Family) -> None:
        self.redis, self.prefix, self.client, self.checks = redis, prefix, client, checks
        self._models: dict[str, ModelTokenizer] = {}
        self._looked_at: dict[str, float] = {}
        self._distrusted: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def count(
        self,
        model: str,
        url: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        ids: bool = False,
    ) -> Counted | None:
        """The prompt's count for the engine at ``url`` - with its token ids where ``ids`` and
        the model's files give them, for the KV index's lookup (gateway.engines.kv_index) -
        or None where the engine must be asked."""
        tokenizer = self._models.get(model)
        if tokenizer is None:
            self._load_later(model)
            return None
        counted = tokenizer.measure(messages, tools, ids)
        if counted is not None and tokenizer.checking():
            self._spawn(self._check(model, url, messages, tools, counted.tokens))
        return counted

    def prepare(self, models: list[str]) -> None:
        """Start loading the files of models the pool serves, before their first round: a
        placement by the engines' caches needs the first round's token ids too."""
        for model in models:
            if model not in self._models:
                self._load_later(model)

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
