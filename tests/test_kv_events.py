"""KV events: the KV cache's records, surface.kv_events against vLLM's own structs and hash,
and the GPU-free engine publishing them over ZMQ (vLLM's engines: tests/test_vllm.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import zmq

from rounds.engine.kv_cache import BlockEvicted, BlocksStored, CacheCleared, KVCache
from surface import kv_events as wire
from surface.registry import WorkerInfo, live_workers
from tests.engines import start_sim_worker, stop
from workers.vllm.launch import KVEvents, VllmLaunch, server_argv

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database
RECEIVE_S = 30.0


# -- the KV cache's records (pure) ----------------------------------------------------------


@pytest.mark.unit
def test_the_cache_records_stores_evictions_and_a_reset_as_vllms_block_pool_queues_them():
    kv = KVCache(num_blocks=3, block_size=2, hasher=wire.BlockHasher(), record_events=True)
    tokens, hashes = [1, 2, 3, 4, 5], []
    kv.hash_blocks(hashes, tokens, "tenant")
    blocks = kv.allocate(3)
    kv.cache_full_blocks(blocks, hashes, 0, 1, tokens, "tenant")
    kv.cache_full_blocks(blocks, hashes, 1, 2, tokens, "tenant")
    assert kv.take_events() == [
        BlocksStored([hashes[0]], None, [1, 2], 2, "tenant"),
        BlocksStored([hashes[1]], hashes[0], [3, 4], 2, None),
    ]
    assert kv.take_events() == []
    assert not kv.reset_prefix_cache()  # blocks in use: refused, as vLLM's
    kv.free(blocks)
    kv.allocate(3)  # the tail first: the second block, then the first
    assert kv.take_events() == [BlockEvicted(hashes[1]), BlockEvicted(hashes[0])]
    kv.free([0, 1, 2])
    assert kv.reset_prefix_cache() and kv.take_events() == [CacheCleared()]


@pytest.mark.unit
def test_the_simulators_cache_records_nothing_and_keeps_its_cheap_hash():
    kv = KVCache(num_blocks=4, block_size=2)
    hashes: list = []
    kv.hash_blocks(hashes, [1, 2, 3, 4], None)
    assert hashes == [hash((0, 1, 2)), hash((hash((0, 1, 2)), 3, 4))]
    kv.cache_full_blocks(kv.allocate(2), hashes, 0, 2, [1, 2, 3, 4], None)
    assert kv.events == []


@pytest.mark.unit
def test_the_hash_chains_over_blocks_and_salts_only_the_first():
    hasher = wire.BlockHasher()
    tokens = list(range(40))
    plain, salted = hasher.external(tokens, 16), hasher.external(tokens, 16, "tenant")
    assert len(plain) == 2 and all(0 <= h < 2**64 for h in plain)
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt reaches every block through the chain
    assert hasher.external(tokens[:16] + [9] * 16, 16)[0] == plain[0]
    assert wire.BlockHasher("7").external(tokens, 16) != plain


# -- the seam: vLLM's own structs and hash, in vLLM's environment ----------------------------

SEAM = """
import msgspec
from vllm.distributed import kv_events as v
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as u
from surface import kv_events as s

u.init_none_hash(sha256)
tokens, parent, ours = list(range(100, 140)), None, []
for start in (0, 16):
    extra = (("cache_salt", "tenant"),) if start == 0 else None
    parent = u.hash_block_tokens(sha256, parent, tokens[start:start + 16], extra)
    ours.append(u.maybe_convert_block_hash(parent))
assert ours == s.BlockHasher(u.get_none_hash_seed()).external(tokens, 16, "tenant"), "vLLM's block hash changed"
assert u.get_none_hash_seed() == s.hash_seed({}), "vLLM's NONE_HASH seed changed"
batch = v.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
    v.BlockStored(block_hashes=ours, parent_block_hash=None, token_ids=tokens[:32], block_size=16, lora_id=None,
                  medium="GPU", lora_name=None, extra_keys=[("tenant",), None], group_idx=0),
    v.BlockRemoved(block_hashes=[ours[1]], medium="GPU", group_idx=0),
    v.AllBlocksCleared(),
])
payload = msgspec.msgpack.Encoder().encode(batch)
assert s.encode_batch(s.decode_batch(payload)) == payload, "vLLM's KV event encoding changed"
print("ok")
"""


def test_the_mirror_matches_vllms_own_structs_and_hash():
    """Runs in vLLM's environment with ampd's surface on the path: vLLM's events, encoded by
    vLLM, decode here and encode back to the same bytes; its hash equals ours."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM's CPU build is not installed at {VLLM_PYTHON} (`make test` installs it)")
    done = subprocess.run([str(VLLM_PYTHON), "-c", SEAM], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# -- the GPU-free engine ---------------------------------------------------------------------


def subscriber(endpoint: str, poke: Callable[[], object]) -> tuple[zmq.Socket, list[tuple[int, wire.KVEventBatch]]]:
    """A SUB socket that has seen the engine publish, and the batches it saw doing so. A PUB
    socket drops what it sends before a subscription lands (ZMQ's slow joiner), so the
    engine is poked - a request that stores a block - until a batch arrives; then what the
    pokes published is drained, so the test's own batches come next."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 1000)
    sub.connect(endpoint)
    seen, deadline = [], time.monotonic() + RECEIVE_S
    while not seen:
        assert time.monotonic() < deadline, f"nothing published on {endpoint} within {RECEIVE_S} s"
        poke()
        with contextlib.suppress(zmq.Again):
            seen.append(wire.read_frames(sub.recv_multipart()))
    sub.setsockopt(zmq.RCVTIMEO, 500)
    with contextlib.suppress(zmq.Again):
        while True:
            seen.append(wire.read_frames(sub.recv_multipart()))
    sub.setsockopt(zmq.RCVTIMEO, int(RECEIVE_S * 1000))
    return sub, seen


def poke(url: str, model: str, block_size: int) -> Callable[[], object]:
    """A request that stores one block of its own (a fresh cache salt each time)."""
    body = {"model": model, "prompt": [7] * (block_size + 1), "max_tokens": 1}
    return lambda: httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": uuid.uuid4().hex}, timeout=120)


def received_until(sub: zmq.Socket, done, what: str) -> list[tuple[int, wire.KVEventBatch]]:
    """Batches off the PUB socket until ``done(batches)``."""
    batches: list[tuple[int, wire.KVEventBatch]] = []
    deadline = time.monotonic() + RECEIVE_S
    while not done(batches):
        assert time.monotonic() < deadline, f"no {what} within {RECEIVE_S} s: {batches}"
        read = wire.read_frames(sub.recv_multipart())
        assert read is not None
        batches.append(read)
    return batches


def replayed(endpoint: str, first: int) -> list[tuple[int, wire.KVEventBatch]]:
    """Every batch the engine still buffers from seq ``first`` on (vLLM's replay protocol)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, int(RECEIVE_S * 1000))
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", wire.seq_bytes(first)])
        out = []
        while (read := wire.read_frames(dealer.recv_multipart()[1:])) is not None:
            out.append(read)
        return out
    finally:
        dealer.close(linger=0)


def stored(batches: list[tuple[int, wire.KVEventBatch]]) -> list[wire.BlockStored]:
    return [e for _, b in batches for e in b.events if isinstance(e, wire.BlockStored)]


def registered(prefix: str) -> WorkerInfo:
    async def read() -> list[WorkerInfo]:
        async with aioredis.from_url(REDIS_URL, decode_responses=True) as r:
            return await live_workers(r, prefix)

    deadline = time.monotonic() + RECEIVE_S
    while not (found := asyncio.run(read())):
        assert time.monotonic() < deadline, "the engine did not register"
        time.sleep(0.2)
    return found[0]


def test_the_gpu_free_engine_publishes_vllms_events_with_vllms_hashes(tmp_path):
    prefix = f"kv-{uuid.uuid4().hex[:8]}"
    options = ("--num-blocks", "20", "--block-size", "16", "--max-model-len", "320", "--redis-url", REDIS_URL,
               "--redis-prefix", prefix)  # fmt: skip
    engine = start_sim_worker(tmp_path, *options)
    try:
        info = registered(prefix)
        assert (info.kv_hash_algo, info.kv_hash_seed) == ("sha256", wire.DEFAULT_SEED)
        sub, warming = subscriber(info.kv_events, poke(engine.url, engine.model, 16))
        hasher = wire.BlockHasher(info.kv_hash_seed)

        def complete(text: str, salt: str | None = None) -> list[int]:
            ids = httpx.post(f"{engine.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
            body = {"model": engine.model, "prompt": ids, "max_tokens": 1, "cache_salt": salt}
            assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30).status_code == 200
            return ids

        first = complete(" ".join(f"alpha{i}" for i in range(120)), salt="tenant")
        want = hasher.external(first, 16, "tenant")
        batches = received_until(sub, lambda b: sum(len(e.block_hashes) for e in stored(b)) >= len(want), "store")
        events = [e for e in stored(batches) if set(e.block_hashes) <= set(want)]  # not a late poke's
        assert [h for e in events for h in e.block_hashes] == want
        assert events[0].parent_block_hash is None and events[0].extra_keys[0] == ("tenant",)
        assert [t for e in events for t in e.token_ids] == first[: len(want) * 16]
        seq, batch = next((s, b) for s, b in batches if events[0] in b.events)
        assert replayed(info.kv_events_replay, seq)[0] == (seq, batch)

        complete(" ".join(f"beta{i}" for i in range(250)))  # needs more blocks than are free: evicts
        removed = received_until(
            sub, lambda b: any(isinstance(e, wire.BlockRemoved) for _, x in b for e in x.events), "removal"
        )
        gone = {h for _, b in removed for e in b.events if isinstance(e, wire.BlockRemoved) for h in e.block_hashes}
        known = {h for e in stored(warming + batches + removed) for h in e.block_hashes}
        assert gone and gone <= known  # only blocks it said it stored

        assert httpx.post(f"{engine.url}/reset_prefix_cache", timeout=30).json() == {"success": True}
        cleared = received_until(
            sub, lambda b: any(isinstance(e, wire.AllBlocksCleared) for _, x in b for e in x.events), "clear"
        )
        assert cleared
        sub.close(linger=0)
    finally:
        stop(engine)


@pytest.mark.unit
def test_ampd_worker_vllm_turns_vllms_events_on_and_says_where():
    launch = VllmLaunch("m", advertise_host="10.0.0.7", kv_events=KVEvents(5557, 5558))
    argv = server_argv(launch)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558"}  # fmt: skip
    assert launch.kv_events_endpoints == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert VllmLaunch("m", extra_args=("--prefix-caching-hash-algo", "xxhash")).kv_hash_algo == "xxhash"
    assert "--kv-events-config" not in server_argv(VllmLaunch("m"))
    assert wire.hash_seed({"PYTHONHASHSEED": "3"}) == "3" and wire.hash_seed({}) == wire.DEFAULT_SEED
