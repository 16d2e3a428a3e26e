"""Measure a running engine over a grid (I/O); planner.profiler.fit turns the samples into a profile.

Any engine with vLLM's OpenAI HTTP surface (real vLLM or the GPU-free ``ampd worker
sim``) is timed over a :class:`~planner.profiler.samples.Grid`:

- *prefill*: for each (l_hist, l_incr), a prompt of l_hist fresh random tokens warms
  the prefix cache (``max_tokens=1``), then the streamed time to first token of that
  prompt extended by l_incr new tokens is one step T_pre(l_hist, l_incr). The cache
  hit is checked on ``vllm:prefix_cache_hits``; the sample records what really hit.
- *decode*: b concurrent streams with c-token prompts (``ignore_eos``); once every
  stream has its first token the batch decodes alone, and each stream's mean
  inter-token gap over the following ``steady_tokens`` tokens is one decode step of
  batch b; the median over streams is the sample, with the batch's mean total context.
- *KV transfer* (with a prefill worker): vLLM's NixlConnector hand-off as the gateway
  runs it. By the engine's clock T_kv(l) is the engine's own time for the pull (the
  growth of ``vllm:nixl_xfer_time_seconds_sum``); by the client's, the decode request's
  time to first token less the recompute of the last prompt token, T_pre(l - 1, 1),
  measured on the decode engine separately (l - 1 a multiple of the block size, so the
  cache hit is exact).

Every time is a median over ``repeats`` fresh samples (the engine's own time for a KV pull
is the least of them, see ``_transfer_point``), multiplied by ``speed`` (a
GPU-free worker started with ``--speed s`` runs s times faster than the GPU it
models). Nothing else is subtracted. First tokens are timed by one of two clocks:
``clock="client"`` from sending the request to receiving its token, so HTTP, JSON and
API-server overhead is inside every prefill and transfer sample and ends up in the
fitted constants (mostly forward's intercept); ``clock="engine"`` reads the engine's
own TTFT (the growth of ``vllm:time_to_first_token_seconds_sum`` across the lone
request), which leaves the HTTP part out. Both are recorded; the median difference is
``Measurements.api_overhead_seconds``. Decode steps are timed by the same clock: at
the client, the slope of token arrivals (it carries no per-request overhead, but a
client starved of its CPU reads a burst of buffered tokens at once and times steps too
short: 17x, seen once on a loaded two-core machine); by the engine's, the mean of
``vllm:inter_token_latency_seconds`` over the steady window (the growth of its sum
over the growth of its count), which vLLM and the GPU-free engine take per token.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from planner.profiler.samples import (
    DEFAULT_GRID,
    Clock,
    DecodeSample,
    Grid,
    Measurements,
    PrefillSample,
    TransferSample,
)
from surface import wire

Progress = Callable[[str], None]

STATS_WAIT_S = 10.0  # how long an engine may take to publish a request's stats
# Ordinary text the served model's tokenizer splits into the ids random prompts are drawn from.
VOCABULARY_TEXT = " ".join(
    [f"{a}{b}{c}" for a in "bdfgklmnprstvz" for b in "aeiou" for c in "nrst"]
    + list(string.digits + string.ascii_uppercase + string.punctuation)
)
MIN_VOCABULARY = 64  # distinct ids: fewer, and two random prompts could share a cached prefix


class ProfilerError(RuntimeError):
    """The engine answered something the profiler cannot use."""


class ShortWindow(ProfilerError):
    """The decode streams ran out of tokens before the steady window was long enough.

    ``max_tokens`` is sized for a client that starts the batch's streams together and reads
    them as they come; a client starved of its CPU while the engine decodes on starts them
    apart, or takes the engine's counters late. The point is worth retrying with more
    tokens per stream.
    """


@dataclass(frozen=True)
class Timed:
    """One first token, by both clocks (wall seconds)."""

    client_s: float
    engine_s: float | None  # None where the engine exports no TTFT histogram
    prefix_hits: float | None  # prompt tokens the prefix cache supplied, if the engine says
    clock: Clock
    transfer_s: float | None = None  # the engine's own time for the request's one KV pull, if asked

    @property
    def seconds(self) -> float:
        if self.clock == "client":
            return self.client_s
        if self.engine_s is None:
            raise ProfilerError("the engine clock needs vllm:time_to_first_token_seconds, which the engine lacks")
        return self.engine_s


def _growth(before: dict[str, float] | None, after: dict[str, float] | None, *names: str) -> float | None:
    """How much the first of ``names`` present in both scrapes grew."""
    if before is None or after is None:
        return None
    for name in names:
        if name in before and name in after:
            return after[name] - before[name]
    return None


@dataclass
class _Target:
    """One engine under measurement."""

    client: httpx.AsyncClient
    url: str
    model: str
    clock: Clock = "client"
    timings: list[Timed] = field(default_factory=list)

    async def metrics(self) -> dict[str, float] | None:
        """Samples of /metrics by name (labels dropped, summed), or None if it has none."""
        try:
            response = await self.client.get(f"{self.url}/metrics", timeout=10)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return wire.metric_totals(response.text)

    def body(self, prompt: list[int], max_tokens: int, **extra: Any) -> bytes:
        payload = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
        return json.dumps(payload, separators=(",", ":")).encode()

    async def complete(self, prompt: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
        response = await self.client.post(
            f"{self.url}/v1/completions", content=self.body(prompt, max_tokens, **extra), headers=_JSON
        )
        if response.status_code != 200:
            raise ProfilerError(f"{self.url}/v1/completions: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    async def first_token(self, prompt: list[int], pulls: bool = False, **extra: Any) -> Timed:
        """Time a streamed one-token completion on an otherwise idle engine.

        The client clock runs from sending the (already encoded) request to receiving
        its token; the engine clock is the engine's own TTFT for it, the growth of
        ``vllm:time_to_first_token_seconds_sum`` across the request. A request that
        ``pulls`` KV from a prefill engine also gets the engine's own time of that pull,
        the growth of ``vllm:nixl_xfer_time_seconds_sum``.
        """
        before = await self.metrics()
        client_s = await self._stream_one_token(prompt, **extra)
        after = await self.metrics()
        wanted = [f"{wire.TTFT}_count"] + ([f"{wire.NIXL_TRANSFER_TIME}_count"] if pulls else [])
        deadline = time.monotonic() + STATS_WAIT_S
        # vLLM records a step's stats, and its connector's transfer stats, a moment after the output
        while any(_growth(before, after, name) == 0 for name in wanted) and time.monotonic() < deadline:
            await asyncio.sleep(0.025)
            after = await self.metrics()
        count = _growth(before, after, f"{wire.TTFT}_count")
        hits = _growth(before, after, f"{wire.PREFIX_CACHE_HITS}_total", wire.PREFIX_CACHE_HITS)
        engine_s = _growth(before, after, f"{wire.TTFT}_sum") if count == 1 else None
        if self.clock == "engine" and count not in (None, 1):
            raise ProfilerError(f"{self.url}: {count} first tokens during one request; is something else using it?")
        transfer_s = None
        if pulls and _growth(before, after, f"{wire.NIXL_TRANSFER_TIME}_count") == 1:
            transfer_s = _growth(before, after, f"{wire.NIXL_TRANSFER_TIME}_sum")
        timed = Timed(client_s, engine_s, hits, self.clock, transfer_s)
        self.timings.append(timed)
        return timed

    async def _stream_one_token(self, prompt: list[int], **extra: Any) -> float:
        content = self.body(prompt, 1, stream=True, **extra)
        first: float | None = None
        start = time.perf_counter()
        async with self.client.stream("POST", f"{self.url}/v1/completions", content=content, headers=_JSON) as r:
            if r.status_code != 200:
                raise ProfilerError(f"{self.url}/v1/completions: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ProfilerError(f"{self.url} failed mid-stream: {chunk['error']}")
                if first is None and chunk.get("choices"):
                    first = time.perf_counter()
        if first is None:
            raise ProfilerError(f"{self.url}: the stream ended without a token")
        return first - start

    async def vocabulary(self) -> list[int]:
        """The distinct ids the engine's ``/tokenize`` gives for ordinary text, special tokens left out."""
        body = {"model": self.model, "prompt": VOCABULARY_TEXT, "add_special_tokens": False}
        response = await self.client.post(f"{self.url}/tokenize", json=body)
        if response.status_code != 200:
            raise ProfilerError(f"{self.url}/tokenize: HTTP {response.status_code}: {response.text[:500]}")
        return sorted(set(response.json()["tokens"]))

    async def busy(self) -> float | None:
        """The requests running or waiting on the engine; None where it publishes no metrics."""
        metrics = await self.metrics()
        return None if metrics is None else metrics.get(wire.RUNNING, 0) + metrics.get(wire.WAITING, 0)

    async def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until no request runs or waits (aborted streams take a moment to go)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = await self.busy()
            if busy is None:
                await asyncio.sleep(0.5)
                return
            if busy == 0:
                return
            await asyncio.sleep(0.05)
        raise ProfilerError(f"{self.url} did not go idle within {timeout_s:.0f} s")


_JSON = {"Content-Type": "application/json"}
# A connection idle this long is not reused: vLLM's server (uvicorn) closes one after 5 s, and
# one it closes just as a request goes out on it fails the request (ReadError), which
# happened on a loaded machine with httpx's default of 5 s.
KEEPALIVE_S = 1.0


class Prompts:
    """Fresh random prompts, drawn from ids the served model's own tokenizer gives for
    ordinary text (:meth:`_Target.vocabulary`): any fixed id range is out of some model's
    vocabulary (a dummy-weight test model's has a few hundred entries), and vLLM refuses
    a prompt holding an id past it."""

    def __init__(self, rng: random.Random, ids: list[int]) -> None:
        if len(ids) < MIN_VOCABULARY:
            raise ProfilerError(f"the engine's tokenizer gave {len(ids)} distinct ids for ordinary text; "
                                f"random prompts need at least {MIN_VOCABULARY}")  # fmt: skip
        self.rng, self.ids = rng, ids

    def __call__(self, n: int) -> list[int]:
        return self.rng.choices(self.ids, k=n)


async def _models(client: httpx.AsyncClient, url: str) -> tuple[str, int]:
    response = await client.get(f"{url}/v1/models")
    if response.status_code != 200:
        raise ProfilerError(f"{url}/v1/models: HTTP {response.status_code}")
    entry = response.json()["data"][0]
    return entry["id"], int(entry.get("max_model_len") or 0)


async def _kv_capacity(t: _Target, fresh: Prompts, max_model_len: int) -> tuple[int | None, int | None, str]:
    """(KV capacity in tokens, block size, where they came from).

    vLLM exports ``vllm:cache_config_info`` (labels num_gpu_blocks, block_size). Where
    that is missing (the GPU-free engine), a probe holds a known number of tokens and
    reads ``vllm:kv_cache_usage_perc``: capacity = tokens / usage, within a block.
    """
    response = await t.client.get(f"{t.url}/metrics", timeout=10)
    found = wire.cache_config(response.text) if response.status_code == 200 else None
    if found is not None:
        blocks, size = found
        return blocks * size, size, "vllm:cache_config_info"
    held = min(8192, max_model_len // 2)
    usage = await _usage_while_holding(t, fresh(held))
    if usage is None or usage <= 0:
        return None, None, "unknown (no vllm:cache_config_info, no usable vllm:kv_cache_usage_perc)"
    return int(round(held / usage)), None, f"vllm:kv_cache_usage_perc while holding {held} tokens"


async def _usage_while_holding(t: _Target, prompt: list[int]) -> float | None:
    content = t.body(prompt, 64, stream=True)
    usage: float | None = None
    async with t.client.stream("POST", f"{t.url}/v1/completions", content=content, headers=_JSON) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                metrics = await t.metrics()
                usage = None if metrics is None else metrics.get(wire.KV_USAGE)
                break  # leaving the block closes the stream: the engine aborts the request
    await t.wait_idle()
    return usage


async def _prefill_point(t: _Target, fresh: Prompts, l_hist: int, l_incr: int, repeats: int) -> PrefillSample:
    runs: list[float] = []
    hits: list[float] = []
    for _ in range(repeats):
        history = fresh(l_hist)
        if l_hist:
            await t.complete(history)
        timed = await t.first_token(history + fresh(l_incr))
        runs.append(timed.seconds)
        hits.append(l_hist if timed.prefix_hits is None else timed.prefix_hits)
    hit = int(statistics.median(hits))
    return PrefillSample(l_hist=hit, l_incr=l_hist + l_incr - hit, seconds=statistics.median(runs), runs=runs)


async def _decode_point_retried(
    t: _Target,
    fresh: Prompts,
    batch: int,
    context: int,
    steady: int,
    max_tokens: int,
    limit: int,
    say: Progress,
) -> DecodeSample:
    """:func:`_decode_point`, with twice the tokens per stream after a :class:`ShortWindow`.

    How late a loaded client is can only be seen by running the point. Streams are
    closed once the window is long enough, so the extra tokens cost the engine nothing;
    ``limit`` (the model's length, the KV capacity) bounds them.
    """
    while True:
        try:
            return await _decode_point(t, fresh, batch, context, steady, max_tokens)
        except ShortWindow as exc:
            if max_tokens >= limit:
                raise
            max_tokens = min(2 * max_tokens, limit)
            say(f"{exc}; again with max_tokens {max_tokens}")


async def _decode_point(
    t: _Target, fresh: Prompts, batch: int, context: int, steady: int, max_tokens: int
) -> DecodeSample:
    """b concurrent streams; the gaps after the last stream's first token are pure decode steps."""
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(batch)]  # (time, completion tokens so far)
    window_start: list[int] | None = None
    started, enough = asyncio.Event(), asyncio.Event()  # the steady window began; it is long enough
    over = asyncio.Event()  # the point is over: each stream leaves at its next chunk
    failure: list[str] = []
    short: list[str] = []  # the streams that ran out of tokens before the window was long enough

    def end(reasons: list[str], reason: str) -> None:
        reasons.append(reason)
        started.set()
        enough.set()

    def observe(i: int, now: float, count: int) -> None:
        nonlocal window_start
        arrivals[i].append((now, count))
        if window_start is None and all(arrivals):
            window_start = [len(a) for a in arrivals]  # each window begins with the next arrival
        if window_start is None:
            return
        started.set()
        if all(len(a) - s >= steady + 1 for a, s in zip(arrivals, window_start, strict=True)):
            enough.set()

    async def stream(i: int) -> None:
        try:
            await read(i)
        except Exception as exc:  # a broken stream, a chunk that is not JSON: the wait must end
            end(failure, f"{type(exc).__name__}: {exc}")

    async def read(i: int) -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        content = t.body(fresh(context), max_tokens, stream=True, stream_options=options)
        if over.is_set():
            return
        async with t.client.stream("POST", f"{t.url}/v1/completions", content=content, headers=_JSON) as r:
            if r.status_code != 200:
                end(failure, f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                return
            async for line in r.aiter_lines():
                if over.is_set():
                    return
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                usage = chunk.get("usage") or {}
                count = int(usage.get("completion_tokens") or (arrivals[i][-1][1] + 1 if arrivals[i] else 1))
                observe(i, now, count)
        if not enough.is_set():
            end(short, f"a stream finished after {len(arrivals[i])} chunks, before the batch was steady")

    tasks = [asyncio.create_task(stream(i)) for i in range(batch)]
    before = after = None
    try:
        if t.clock == "engine":
            await started.wait()
            before = await t.metrics()
        await enough.wait()
        if t.clock == "engine":
            # A client that fell behind read its window in one burst, sooner than the engine
            # took its steps: the engine's window is as long as it says.
            after = await t.metrics()
            while (
                not (failure or short)
                and (_growth(before, after, f"{wire.ITL}_count") or 0) < batch * steady
                and not all(task.done() for task in tasks)
            ):
                await asyncio.sleep(0.02)
                after = await t.metrics()
    finally:
        # Each stream leaves at its next chunk and closes its response itself (which aborts
        # the engine's request); none is cancelled. httpx keeps a pooled connection taken
        # when a task is cancelled while it closes a response, or between connecting and
        # sending (httpcore's shields do not hold against asyncio's own cancel): a profile's
        # retried points lost connections try by try until the pool timed out.
        over.set()
        await asyncio.gather(*tasks)  # each left, or ended through end()
        await t.wait_idle()
    where = f"decode batch {batch} x {context}"
    if failure:
        raise ProfilerError(f"{where}: {failure}")
    if short:
        raise ShortWindow(f"{where}: {short[0]}")
    assert window_start is not None
    steps, itl = _growth(before, after, f"{wire.ITL}_count"), _growth(before, after, f"{wire.ITL}_sum")
    if t.clock == "engine":
        if steps is None or itl is None:
            raise ProfilerError(f"the engine clock needs {wire.ITL}, which {t.url} lacks")
        if steps < batch * steady:  # a starved client read `before` late: the streams ended first
            raise ShortWindow(f"{where}: the engine timed {steps:.0f} tokens in the window, not {batch * steady}")
    slopes, contexts = [], []
    for a, s in zip(arrivals, window_start, strict=True):
        (t0, n0), (t1, n1) = a[s], a[-1]
        slopes.append((t1 - t0) / (n1 - n0))
        # The step that produces token n reads c + n - 2 cached tokens (the sim's and
        # perfmodel.profile's convention: the tokens computed before the step).
        contexts.append(context + (n0 + 1 + n1) / 2 - 2)
    seconds = itl / steps if steps and itl is not None else statistics.median(slopes)
    return DecodeSample(batch=batch, context=sum(contexts), seconds=seconds, prompt_tokens=context)


async def _transfer_point(
    decode: _Target, prefill: _Target, fresh: Prompts, tokens: int, repeats: int
) -> tuple[float, float, float | None]:
    """Medians of the hand-off's TTFT and of T_pre(tokens - 1, 1), and the least of the
    engine's own times for the pull (None where it exports none), on the decode engine,
    wall clock. A pull is short (milliseconds) and whatever else runs on the host only ever
    lengthens it - a late wake-up, a contended copy - so its shortest repeat is the one
    closest to its cost; a median of three is off when two repeats were delayed."""
    totals, recomputes, pulls = [], [], []
    for _ in range(repeats):
        prompt = fresh(tokens)
        params = (await prefill.complete(prompt, kv_transfer_params=wire.PREFILL_PARAMS)).get("kv_transfer_params")
        if not params:
            raise ProfilerError(f"{prefill.url} returned no kv_transfer_params (is it a NIXL kv_producer?)")
        handoff = await decode.first_token(prompt, pulls=True, kv_transfer_params=params)
        totals.append(handoff.seconds)
        if handoff.transfer_s is not None:
            pulls.append(handoff.transfer_s)
        other = fresh(tokens)
        await decode.complete(other[:-1])
        recompute = await decode.first_token(other)
        if recompute.prefix_hits is not None and recompute.prefix_hits != tokens - 1:
            raise ProfilerError(
                f"T_pre({tokens - 1}, 1) hit {recompute.prefix_hits:.0f} cached tokens, not {tokens - 1}: "
                "transfer_tokens - 1 must be a multiple of the engine's block size"
            )
        recomputes.append(recompute.seconds)
    pulled = min(pulls) if len(pulls) == repeats else None
    return statistics.median(totals), statistics.median(recomputes), pulled


async def measure(
    url: str,
    *,
    prefill_url: str | None = None,
    grid: Grid = DEFAULT_GRID,
    speed: float = 1.0,
    progress: Progress | None = None,
    clock: Clock = "client",
    seed: int | None = None,
) -> Measurements:
    """Time the engine at ``url`` over ``grid`` (see the module docstring).

    ``prefill_url``, if given, is a prefill (NIXL kv_producer) worker of the same model
    and TP degree, used to time KV hand-offs into ``url``. ``speed``: the engine runs
    this many times faster than the GPU it models (GPU-free workers' ``--speed``);
    stored times are modelled seconds (measured x speed). ``clock``: ``"client"`` or
    ``"engine"``, whose clock times first tokens (module docstring). ``progress`` is
    called with one line per point; ``seed`` fixes the random prompts. The engines
    should serve nothing else meanwhile.
    """
    say = progress or (lambda _: None)
    rng = random.Random(seed)
    limits = httpx.Limits(
        max_connections=max(grid.decode_batch, default=1) + 16,
        max_keepalive_connections=32,
        keepalive_expiry=KEEPALIVE_S,
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model, max_len = await _models(client, url)
        t = _Target(client, url, model, clock)
        fresh = Prompts(rng, await t.vocabulary())
        await t.complete(fresh(16))  # first-request costs are not the model's
        capacity, block_size, source = await _kv_capacity(t, fresh, max_len)
        say(f"{model} at {url}: max_model_len {max_len}, KV capacity {capacity} tokens ({source})")
        m = Measurements(
            url=url,
            prefill_url=prefill_url,
            model_name=model,
            max_model_len=max_len,
            speed=speed,
            clock=clock,
            kv_capacity_tokens=capacity,
            kv_capacity_source=source,
            block_size=block_size,
            repeats=grid.repeats,
            measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )

        for l_hist in grid.prefill_hist:
            for l_incr in grid.prefill_incr:
                if l_hist + l_incr + 1 > max_len:
                    continue
                s = await _prefill_point(t, fresh, l_hist, l_incr, grid.repeats)
                s = s.model_copy(update={"seconds": s.seconds * speed, "runs": [r * speed for r in s.runs]})
                m.prefill.append(s)
                say(f"prefill l_hist={s.l_hist} l_incr={s.l_incr}: {1e3 * s.seconds:.2f} ms")

        for batch in grid.decode_batch:
            for context in grid.decode_context:
                headroom = grid.steady_tokens + 4 + math.ceil(batch * context / grid.min_chunk_tokens)
                max_tokens = min(headroom, max_len - context)
                limit = max_len - context  # what fits the model and 90% of the KV capacity
                if capacity is not None:
                    limit = min(limit, math.floor(0.9 * capacity / batch) - context)
                if max_tokens < grid.steady_tokens + 2 or max_tokens > limit:
                    continue
                runs = [
                    await _decode_point_retried(t, fresh, batch, context, grid.steady_tokens, max_tokens, limit, say)
                    for _ in range(grid.decode_repeats)
                ]
                s = DecodeSample(
                    batch=batch,
                    context=statistics.median(r.context for r in runs),
                    seconds=statistics.median(r.seconds for r in runs) * speed,
                    prompt_tokens=context,
                )
                m.decode.append(s)
                say(f"decode b={batch} context={s.context:.0f}: {1e3 * s.seconds:.2f} ms/step")

        if prefill_url is not None:
            p_model, p_len = await _models(client, prefill_url)
            p = _Target(client, prefill_url, p_model, clock)
            await p.complete(fresh(16))
            for tokens in grid.transfer_tokens:
                if tokens + 1 > min(max_len, p_len):
                    continue
                total, recompute, pulled = await _transfer_point(t, p, fresh, tokens, grid.repeats)
                # The engine's clock times the pull itself; the client's only the whole hand-off.
                engine_clock = clock == "engine" and pulled is not None
                s = TransferSample(
                    tokens=tokens,
                    seconds=(pulled if engine_clock else total - recompute) * speed,
                    total_seconds=total * speed,
                    recompute_seconds=recompute * speed,
                    clock="engine" if engine_clock else "client",
                )
                m.transfer.append(s)
                say(f"KV transfer of {tokens} tokens: {1e3 * s.seconds:.2f} ms")
        gaps = [x.client_s - x.engine_s for x in t.timings if x.engine_s is not None]
        if gaps:
            m.api_overhead_seconds = statistics.median(gaps) * speed
    return m
