"""`ampd bench kv-index`: what the gateway's KV index (gateway.engines.kv_index) costs.

Three numbers, on one core, with no I/O:

* **ingest**: KV events decoded from vLLM's msgpack (surface.kv_events) and applied to the
  index, per second - the work a replica's subscriber does for every engine's every step.
  The stream is shaped as vLLM's BlockPool sends it: a ``BlockStored`` per request per
  step carrying its newly full blocks, and one ``BlockRemoved`` per evicted block, the
  cache kept full so that every block stored evicts one;
* **lookup**: a prompt's prefix-cache hit on every engine - its token ids hashed into the
  block chain (surface.kv_events.BlockHasher, vLLM's sha256) and matched - for a
  ``--prompt-tokens`` prompt (32k by default);
* **memory**: the bytes an engine's view costs per block held (tracemalloc), which with
  the bound (an engine's KV capacity in blocks) bounds the index.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gateway.engines.kv_index import Hashing, KVIndex, cached_tokens
from surface import kv_events as wire

BLOCK = 16
ENGINE = "engine-0"


def event_stream(batches: int, blocks_per_store: int, capacity_blocks: int, rng: random.Random) -> list[bytes]:
    """Encoded batches of one engine: each stores ``blocks_per_store`` new blocks and, once
    the cache is full, evicts as many of the oldest, one ``BlockRemoved`` each."""
    held: list[int] = []
    payloads = []
    for _ in range(batches):
        new = [rng.getrandbits(64) for _ in range(blocks_per_store)]
        events: list[wire.KVEvent] = [
            wire.BlockStored(
                new, held[-1] if held else None, [1] * BLOCK * len(new), BLOCK, None, wire.MEDIUM_GPU, None, group_idx=0
            )  # fmt: skip
        ]
        held.extend(new)
        while len(held) > capacity_blocks:
            events.append(wire.BlockRemoved([held.pop(0)], wire.MEDIUM_GPU, group_idx=0))
        payloads.append(wire.encode_batch(wire.KVEventBatch(time.time(), events, 0)))
    return payloads


def ingest(payloads: list[bytes], capacity_blocks: int) -> tuple[float, int]:
    """(CPU seconds, events) to decode and apply every payload to a fresh index."""
    index = KVIndex()
    index.track(ENGINE, capacity_blocks * BLOCK)
    events = 0
    started = time.process_time()
    for payload in payloads:
        batch = wire.decode_batch(payload)
        index.apply(ENGINE, batch)
        events += len(batch.events)
    return time.process_time() - started, events


def lookup_s(prompt_tokens: int, engines: int, repeats: int, rng: random.Random) -> tuple[list[float], int]:
    """Seconds per lookup of one prompt over ``engines`` engines holding its first half, and
    the tokens found cached (a check that the lookup matched)."""
    ids = [rng.randrange(128_000) for _ in range(prompt_tokens)]
    index, hashing = KVIndex(), {}
    chain = wire.BlockHasher().external(ids[:-1], BLOCK)
    for e in range(engines):
        name = f"engine-{e}"
        index.track(name, 0)
        stored = wire.BlockStored(chain[: len(chain) // 2], None, [], BLOCK, None, wire.MEDIUM_GPU, None)
        index.apply(name, wire.KVEventBatch(0.0, [stored]))
        hashing[name] = Hashing(wire.DEFAULT_SEED, BLOCK)
    times, found = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        found = cached_tokens(index, hashing, ids, None)[ENGINE]
        times.append(time.perf_counter() - started)
    return times, found


def bytes_per_block(blocks: int, rng: random.Random) -> float:
    """Memory an engine's view keeps per block: the set's slots and the hashes' int objects
    (decoded from the wire, as the subscriber's are), the batch itself let go."""
    stored = wire.BlockStored([rng.getrandbits(64) for _ in range(blocks)], None, [], BLOCK, None, "GPU", None)
    payload = wire.encode_batch(wire.KVEventBatch(0.0, [stored]))
    del stored
    index = KVIndex()
    index.track(ENGINE, 0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    batch = wire.decode_batch(payload)
    index.apply(ENGINE, batch)
    del batch
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held / blocks


def run_kv_index_bench(
    console: Console, batches: int, blocks_per_store: int, capacity_blocks: int, prompt_tokens: int, engines: int,
    repeats: int, out: Path | None,
) -> int:  # fmt: skip
    rng = random.Random(0)
    payloads = event_stream(batches, blocks_per_store, capacity_blocks, rng)
    cpu_s, events = ingest(payloads, capacity_blocks)
    times, found = lookup_s(prompt_tokens, engines, repeats, rng)
    per_block = bytes_per_block(capacity_blocks, rng)
    result = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "block_size": BLOCK,
        "ingest": {
            "batches": batches,
            "events": events,
            "blocks_per_store": blocks_per_store,
            "capacity_blocks": capacity_blocks,
            "cpu_s": cpu_s,
            "events_per_s_per_core": events / cpu_s,
            "batches_per_s_per_core": batches / cpu_s,
        },  # fmt: skip
        "lookup": {
            "prompt_tokens": prompt_tokens,
            "engines": engines,
            "repeats": repeats,
            "cached_tokens_found": found,
            "median_ms": statistics.median(times) * 1e3,
            "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))] * 1e3,
        },  # fmt: skip
        "memory": {"blocks": capacity_blocks, "bytes_per_block": per_block},
    }
    table = Table("measure", "value")
    table.add_row("events ingested /s /core", f"{result['ingest']['events_per_s_per_core']:,.0f}")
    table.add_row("batches ingested /s /core", f"{result['ingest']['batches_per_s_per_core']:,.0f}")
    lookup = f"lookup, {prompt_tokens} tokens x {engines} engines (median)"
    table.add_row(lookup, f"{result['lookup']['median_ms']:.2f} ms")
    table.add_row("lookup p95", f"{result['lookup']['p95_ms']:.2f} ms")
    table.add_row("bytes per block held", f"{per_block:.1f}")
    console.print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0
