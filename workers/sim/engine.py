"""The real-time shell around the engine core: steps it on the wall clock, streams out.

The scheduler (rounds.engine.scheduler) decides each step and its modelled duration;
this loop waits that duration divided by ``speed`` and hands each request its new
tokens. Deadlines are absolute, so the small cost of Python between steps does not
accumulate into the inter-token latency; when the loop falls behind by more than
``max_lag_s`` it gives up catching up (a real GPU cannot run steps back to back
faster than modelled either).

KV pulls for disaggregated requests run beside the loop, as NIXL transfers run
beside a vLLM engine's forward passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from perfmodel.profile import Profile, t_kv
from rounds.engine.request import Request
from rounds.engine.scheduler import KVLoad, RequestOutput, Scheduler
from workers.sim.kv_events import KVEventPublisher
from workers.sim.kv_transfer import KVSideChannel, TransferError
from workers.sim.metrics import EngineMetrics

log = logging.getLogger(__name__)


@dataclass
class StreamEvent:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    held_block_ids: tuple[int, ...] = ()
    error: str | None = None


@dataclass
class RequestStream:
    """What a handler reads: one event per engine step that produced something."""

    request: Request
    arrival: float
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    last_token_at: float | None = None
    scheduled_at: float | None = None
    pulled_tokens: int = 0


class AsyncEngine:
    def __init__(
        self,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        side_channel: KVSideChannel,
        speed: float = 1.0,
        kv_load_failure_policy: str = "fail",
        max_lag_s: float = 0.010,
        node: str = "",
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.scheduler = scheduler
        self.metrics = metrics
        self.side_channel = side_channel
        self.speed = speed
        self.kv_load_failure_policy = kv_load_failure_policy
        self.max_lag_s = max_lag_s
        self.node = node  # the server it runs on: a pull from one of its own is priced over its interconnect
        self.kv_events = kv_events  # where the KV cache's events go after each step, if anywhere
        self.streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._pulls: set[asyncio.Task] = set()

    @property
    def profile(self) -> Profile:
        return self.scheduler.profile

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        for task in [self._task, *self._pulls]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._pulls] if t is not None), return_exceptions=True)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- requests ------------------------------------------------------------------
    def submit(self, request: Request) -> RequestStream:
        self.scheduler.add_request(request)
        stream = RequestStream(request, arrival=time.monotonic())
        self.streams[request.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """A client went away. vLLM 0.32 frees the request without counting it in
        ``vllm:request_success_total`` (its ``abort`` series stays at 0)."""
        if self.streams.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
        self._wake.set()

    # -- the loop ------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        free_at = loop.time()
        while True:
            step = self.scheduler.schedule(time.monotonic())
            for load in step.kv_loads:
                self._spawn(self._pull(load))
            if step.empty:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # wake up anyway: expire held transfer blocks
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                free_at = loop.time()
                continue
            now = loop.time()
            start = max(free_at, now - self.max_lag_s)
            deadline = start + step.duration / self.speed
            for request, _ in step.prefills:
                stream = self.streams.get(request.request_id)
                if stream is not None and stream.scheduled_at is None:
                    stream.scheduled_at = time.monotonic()
                    self.metrics.queue_time.observe(stream.scheduled_at - stream.arrival)
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let handlers run even when behind
            self.metrics.step_lateness.observe(max(0.0, loop.time() - deadline))
            free_at = deadline
            self._deliver(self.scheduler.finish_step(step, time.monotonic()), step.num_tokens)
            await self.publish_kv_events()

    async def publish_kv_events(self) -> None:
        """What the KV cache recorded since the last call, as one batch (vLLM publishes a
        batch per scheduler step, vllm/v1/core/sched/scheduler.py)."""
        if self.kv_events is not None:
            await self.kv_events.publish(self.scheduler.kv.take_events())

    def _deliver(self, outputs: list[RequestOutput], step_tokens: int) -> None:
        now = time.monotonic()
        generated = 0
        for out in outputs:
            generated += len(out.new_token_ids)
            stream = self.streams.get(out.request.request_id)
            if stream is None:
                continue
            request = out.request
            if stream.first_token_at is None:
                stream.first_token_at = now
                self.metrics.ttft.observe(now - stream.arrival)
                self.metrics.prompt_tokens.inc(request.num_prompt_tokens)
                self._count_sources(request, stream.pulled_tokens)
            else:
                self.metrics.itl.observe(now - (stream.last_token_at or now))
            stream.last_token_at = now
            event = StreamEvent(out.new_token_ids, finished=out.finished, held_block_ids=out.held_block_ids)
            if out.finished:
                event.finish_reason = request.status.value
                self._finished(stream, event.finish_reason, now)
            stream.events.put_nowait(event)
        self.metrics.generation_tokens.inc(generated)

    def _count_sources(self, request: Request, pulled: int) -> None:
        """Where a prompt's tokens came from, as vLLM counts them once its prefill is over
        (vllm/v1/metrics/stats.py, PromptTokenStats): its own prefix cache, another engine's
        KV pulled over NIXL, and computed here - the rest."""
        local = min(request.num_cached_tokens, request.num_prompt_tokens)
        external = min(pulled, request.num_prompt_tokens - local)
        sources = self.metrics.prompt_tokens_by_source
        sources["local_cache_hit"].inc(local)
        sources["external_kv_transfer"].inc(external)
        sources["local_compute"].inc(request.num_prompt_tokens - local - external)

    def _finished(self, stream: RequestStream, reason: str, now: float) -> None:
        self.streams.pop(stream.request.request_id, None)
        self.metrics.e2e.observe(now - stream.arrival)
        self.metrics.request_success[reason].inc()
        self.metrics.request_prompt_tokens.observe(stream.request.num_prompt_tokens)
        self.metrics.request_generation_tokens.observe(stream.request.num_output_tokens)

    # -- disaggregation ----------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def _pull(self, load: KVLoad) -> None:
        """Read the blocks this engine lacks from the prefill engine, then resume.

        The exchange is real (HTTP between the two processes, block contents checked
        against the prompt); its duration is stretched to the modelled T_kv of the
        tokens actually pulled.
        """
        request = load.request
        remote = request.remote_prefill
        assert remote is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        size = self.scheduler.kv.block_size
        try:
            peer = await self.side_channel.handshake(remote.host, remote.port, remote.engine_id)
            if peer.block_size != size:
                raise TransferError(f"block size {peer.block_size} differs from ours ({size})")
            blocks = await self.side_channel.read(peer, remote.request_id, load.remote_block_ids)
            for k, tokens in enumerate(blocks):
                begin = load.first_token + k * size
                if tokens != request.prompt_token_ids[begin : min(begin + size, load.end_token)]:
                    raise TransferError(f"block {load.remote_block_ids[k]} does not hold this prompt's tokens")
            same_node = bool(self.node) and peer.node == self.node
            modelled = t_kv(load.num_tokens, peer.profile, self.profile, same_node) / self.speed
            remaining = modelled - (loop.time() - started)
            if remaining > 0:
                await asyncio.sleep(remaining)
        except TransferError as exc:
            log.warning("KV pull for %s failed: %s", request.request_id, exc)
            self.metrics.nixl_failed.inc()
            self._load_failed(request, str(exc))
            return
        self.metrics.nixl_xfer_time.observe(loop.time() - started)
        # NIXL moves whole blocks, the last one's unused slots included. Descriptors: one per
        # block and KV region (a region per layer in vLLM's LBHNC layout); vLLM merges
        # blocks contiguous on both sides, so its count can be lower.
        blocks = len(load.remote_block_ids)
        self.metrics.nixl_bytes.observe(blocks * size * self.profile.model.kv_bytes_per_token)
        self.metrics.nixl_descriptors.observe(blocks * self.profile.model.num_layers)
        stream = self.streams.get(request.request_id)
        if stream is not None:
            stream.pulled_tokens = load.num_tokens
        self.scheduler.finish_kv_load(request.request_id, ok=True)
        self._wake.set()

    def _load_failed(self, request: Request, reason: str) -> None:
        if self.kv_load_failure_policy == "recompute":
            self.scheduler.finish_kv_load(request.request_id, ok=False)
            self._wake.set()
            return
        stream = self.streams.pop(request.request_id, None)
        if self.scheduler.abort(request.request_id) is None or stream is None:
            return
        self.metrics.request_success["error"].inc()
        stream.events.put_nowait(StreamEvent([], finished=True, finish_reason="error", error=reason))

    def release_transfer(self, request_id: str) -> None:
        self.scheduler.release_transfer(request_id)
        self._wake.set()
