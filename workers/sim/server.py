"""The GPU-free engine's HTTP server: vLLM's OpenAI surface over the simulated core.

Routes, by router: the OpenAI generation routes, ``POST /v1/chat/completions`` and
``POST /v1/completions`` (workers.sim.generation); ``POST /tokenize``
(workers.sim.tokenization); ``GET /health`` (and ``/ping``), ``/version``, ``/v1/models``,
``/metrics`` (workers.sim.operations); and the KV side channel, ``/kv/handshake`` and
``/kv/read`` (workers.sim.handoff, for workers.sim.kv_transfer). Disaggregation follows
vLLM's NixlConnector protocol through ``kv_transfer_params``. Every route reaches the
engine's state, the worker (workers.sim.worker), through ``request.app.state.worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator

from fastapi import FastAPI

from surface.registry import Registration, WorkerInfo, heartbeat_client, publish_tokenizer
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
    )
    await publish_tokenizer(redis, config.redis_prefix, config.model_name, tokenizer_files())
    beat = asyncio.create_task(Registration(redis, config.redis_prefix, info).run())
    try:
        yield
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await redis.aclose()
