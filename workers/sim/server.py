"""The GPU-free engine's HTTP server: vLLM's OpenAI surface over the simulated core.

Routes, by router: the OpenAI generation routes, ``POST /v1/chat/completions`` and
``POST /v1/completions`` (workers.sim.generation); ``POST /tokenize``
(workers.sim.tokenization); ``GET /health`` (and ``/ping``), ``/version``, ``/v1/models``,
``/metrics`` and vLLM's dev route ``POST /reset_prefix_cache`` (workers.sim.operations);
and the KV side channel, ``/kv/handshake`` and ``/kv/read`` (workers.sim.handoff, for
workers.sim.kv_transfer). KV events go out on ZMQ (workers.sim.kv_events). Disaggregation follows
vLLM's NixlConnector protocol through ``kv_transfer_params``. Every route reaches the
engine's state, the worker (workers.sim.worker), through ``request.app.state.worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator

from fastapi import FastAPI

from surface.kv_events import HASH_ALGO
from surface.registry import Registration, WorkerInfo, follow_step_target, heartbeat_client, publish_tokenizer
from workers.sim import generation, handoff, operations, tokenization
from workers.sim.errors import add_error_handlers
from workers.sim.tokenizer import files as tokenizer_files
from workers.sim.worker import SimWorker, WorkerConfig

__all__ = ["WorkerConfig", "create_app"]


def create_app(config: WorkerConfig) -> FastAPI:
    app = FastAPI(title="ampd GPU-free engine", lifespan=_lifespan)
    app.state.worker = SimWorker(config)
    add_error_handlers(app)
    for module in (operations, tokenization, generation, handoff):
        app.include_router(module.router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    w: SimWorker = app.state.worker
    w.engine.start()
    if w.kv_events is not None:
        w.kv_events.start()
    # What exists now (the KV cache's per-block lists, the tokenizer, the app) lives as long
    # as the process: frozen out of the collector's sight, as vLLM's server freezes its heap
    # once started (vllm.utils.gc_utils.freeze_gc_heap), and before the engine registers, so
    # no request waits for the collection. Unfrozen, each full collection walked it and
    # stalled every stream on the engine (docs/studies/load.md).
    gc.collect()
    gc.freeze()
    async with _registered(w):
        yield
    await w.engine.stop()
    await w.side_channel.close()
    if w.kv_events is not None:
        await w.kv_events.close()


@contextlib.asynccontextmanager
async def _registered(w: SimWorker) -> AsyncIterator[None]:
    """Heartbeat into the worker registry while serving, if a Redis is configured, its
    tokenizer and chat template published first, as vLLM's supervisor publishes a model's."""
    config = w.config
    if config.redis_url is None:
        yield
        return
    redis = heartbeat_client(config.redis_url)
    info = WorkerInfo(
        worker_id=f"sim-{config.role}-{config.advertise_host}:{config.port}",
        role=config.role,
        url=config.url,
        model=config.model_name,
        profile=config.profile,
        speed=config.speed,
        kv_capacity_tokens=w.scheduler.kv.num_blocks * w.scheduler.kv.block_size,
        prefill_chunk=config.scheduler.long_prefill_token_threshold,
        splits=True,
        node=config.node_name,
        sized_steps=True,
        kv_events=w.kv_events.endpoint if w.kv_events else "",
        kv_events_replay=w.kv_events.replay_endpoint if w.kv_events else "",
        kv_hash_algo=HASH_ALGO,
        kv_hash_seed=config.kv_hash_seed,
    )
    await publish_tokenizer(redis, config.redis_prefix, config.model_name, tokenizer_files(w.tokenizer.vocab_size))

    def apply(target_ms: float) -> None:
        w.scheduler.keep_steps_to(target_ms / 1000)

    initial_ms = 1000 * config.scheduler.step_target_s
    tasks = [
        asyncio.create_task(Registration(redis, config.redis_prefix, info).run()),
        asyncio.create_task(follow_step_target(redis, config.redis_prefix, info.worker_id, apply, initial_ms)),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await redis.aclose()
