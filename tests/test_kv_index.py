"""The gateway's KV index (gateway.engines.kv_index, kv_subscriber): pure rules, and a real
gateway over GPU-free engines whose view matches what the engines take from their caches
(vLLM's engines: tests/test_vllm.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import zmq

from ampd.local_redis import delete_prefix
from ampd.processes import Child
from gateway.engines.kv_index import Hashing, KVIndex, cached_tokens, request_hashes
from gateway.engines.kv_subscriber import SeqOrder, read
from gateway.engines.model_tokenizer import Counted, ModelTokenizer
from perfmodel.profile import DEFAULT_PROFILE, load_profile
from surface import kv_events as wire
from surface.registry import WorkerInfo, register
from tests.engines import start_gateway, start_sim_worker, stop
from workers.vllm import tiny_model, tokenizer_files
from workers.vllm.launch import VllmLaunch

REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database
BLOCK = 16
WAIT_S = 60.0


def stored(hashes: list[int], parent: int | None = None, medium: str | None = wire.MEDIUM_GPU) -> wire.BlockStored:
    return wire.BlockStored(hashes, parent, [1] * BLOCK * len(hashes), BLOCK, None, medium, None)


def batch(*events: wire.KVEvent) -> wire.KVEventBatch:
    return wire.KVEventBatch(0.0, list(events))


# -- the pure index -------------------------------------------------------------------------


@pytest.mark.unit
def test_the_longest_cached_prefix_stops_at_the_first_block_an_engine_lacks():
    hasher, ids = wire.BlockHasher(), list(range(5 * BLOCK + 1))
    chain = request_hashes(hasher, ids, BLOCK, None)
    assert len(chain) == 5
    index = KVIndex()
    index.track("a", 0)
    index.track("b", 0)
    index.apply("a", batch(stored(chain[:3])))
    index.apply("b", batch(stored(chain), wire.BlockRemoved([chain[1]], wire.MEDIUM_GPU)))
    how = {"a": Hashing(wire.DEFAULT_SEED, BLOCK), "b": Hashing(wire.DEFAULT_SEED, BLOCK)}
    assert cached_tokens(index, how, ids, None) == {"a": 3 * BLOCK, "b": BLOCK}
    assert cached_tokens(index, how, ids, "salt") == {"a": 0, "b": 0}
    assert request_hashes(hasher, ids[: 2 * BLOCK], BLOCK, None) == chain[:1]  # the last token is never cached
    index.apply("a", batch(stored([7], medium="CPU"), wire.AllBlocksCleared()))
    assert index.held_blocks() == [("a", 0), ("b", 4)]
    index.forget("b")
    assert index.held_blocks() == [("a", 0)] and index.cached_blocks("b", chain) == 0


@pytest.mark.unit
def test_an_engine_holds_no_more_blocks_than_its_kv_capacity():
    index = KVIndex()
    index.track("a", capacity_tokens=4 * BLOCK)
    assert index.apply("a", batch(stored([1, 2, 3, 4])))
    assert not index.apply("a", batch(stored([5])))  # a removal was missed: the view is dropped
    assert index.held_blocks() == [("a", 0)]
    index.apply("a", batch(stored([b"\x00" * 24 + (9).to_bytes(8, "big")])))  # bytes hashes: their low 64 bits
    assert index.cached_blocks("a", [9]) == 1


@pytest.mark.unit
def test_sequence_numbers_place_each_batch():
    order = SeqOrder()
    assert order.place(5) == "apply"  # the first seen
    order.last = 5
    assert [order.place(s) for s in (6, 8, 5)] == ["apply", "gap", "skip"]
    order.floor = 3
    assert order.place(2) == "restart" and order.place(4) == "skip"


@pytest.mark.unit
def test_malformed_frames_read_as_nothing():
    good = wire.published_frames(b"", 3, wire.encode_batch(batch(stored([1]))))
    assert read(good) == (3, batch(stored([1])))
    for frames in ([b"x"], [b"", b"123", good[2]], [b"", good[1], b"\xc1garbage"], [b"", wire.END_SEQ, b""],
                   [b"", good[1], wire.encode_batch(batch()) + b"\x00"]):  # fmt: skip
        assert read(frames) is None


@pytest.mark.unit
def test_prompt_ids_are_the_engines_and_none_where_the_files_name_no_ids(tmp_path):
    from surface.hashed_vocab import CONFIG_KEY
    from workers.sim.tokenizer import Tokenizer as SimTokenizer
    from workers.sim.tokenizer import files as sim_files

    model_dir = tiny_model.build(tmp_path / "model")
    tokenizer = ModelTokenizer(tokenizer_files.read(VllmLaunch(str(model_dir))))
    messages = [{"role": "user", "content": "alpha beta <|eot_id|> gamma"}, {"role": "assistant", "content": "d"}]
    text = tokenizer._render(messages, None)
    assert text is not None and tokenizer.gives_ids
    whole = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.count(messages, None) == len(whole)
    # A round under a cache placement renders its prompt once for its count and its ids.
    renders = []
    tokenizer._render = lambda *args: renders.append(args) or text
    assert tokenizer.measure(messages, None, ids=True) == Counted(len(whole), whole) and len(renders) == 1
    assert tokenizer.measure(messages, None) == Counted(len(whole))  # no ids where none are asked for
    # The GPU-free engine's ids are hashes of its pieces: the gateway computes them from its files.
    files = sim_files(32_000)
    sim = ModelTokenizer(files)
    rendered = sim._render(messages, None)
    expected = SimTokenizer(32_000).encode(rendered or "")
    assert rendered is not None and sim.measure(messages, None, ids=True) == Counted(len(expected), expected)
    unnamed = dict(files, config={k: v for k, v in files["config"].items() if k != CONFIG_KEY})
    assert (
        ModelTokenizer(unnamed).measure(messages, None, ids=True).ids is None
    )  # a vocabulary of <unk> alone names none


def test_a_publisher_gone_silent_while_its_engine_works_ages_out():
    """An engine whose publisher stops sending: while it runs no request, silence is what
    an idle engine publishes and its view stays; once it has run requests for longer
    than ``silent_s`` with no batch, its view is dropped (counted) and it is subscribed to
    afresh, so a publisher that comes back is followed again."""
    from gateway.engines.kv_subscriber import KVSubscriber
    from gateway.metrics import GatewayMetrics

    async def run() -> None:
        metrics = GatewayMetrics(tuple)
        index = KVIndex()
        feeds = KVSubscriber(index, metrics.kv_malformed, metrics.kv_dropped, silent_s=0.5)
        pub = zmq.Context.instance().socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        info = WorkerInfo("quiet", "decode", "http://127.0.0.1:9", "m", load_profile(DEFAULT_PROFILE),
                          kv_events=f"tcp://127.0.0.1:{port}", kv_hash_algo="sha256",
                          kv_hash_seed=wire.DEFAULT_SEED)  # fmt: skip

        def silent_drops() -> float:
            text = metrics.exposition().decode()
            return float(re.search(r'^ampd_kv_index_dropped_total\{reason="silent"\} (\S+)$', text, re.M).group(1))

        async def published(seq: int, block: int) -> None:  # PUB drops what it sends before the subscription lands
            deadline = time.monotonic() + WAIT_S
            while block not in index.engines["quiet"].blocks:
                assert time.monotonic() < deadline, "the batch never reached the index"
                pub.send_multipart(wire.published_frames(b"", seq, wire.encode_batch(batch(stored([block])))))
                await asyncio.sleep(0.05)

        try:
            feeds.follow([info], busy=set())
            await published(0, 42)
            for _ in range(8):  # idle past silent_s: nothing is wrong
                feeds.follow([info], busy=set())
                await asyncio.sleep(0.1)
            assert silent_drops() == 0 and index.engines["quiet"].blocks == {42}
            feeds.follow([info], busy={"quiet"})  # it starts working: the silence counts from here
            assert silent_drops() == 0
            await asyncio.sleep(0.7)
            feeds.follow([info], busy={"quiet"})
            assert silent_drops() == 1 and not index.engines["quiet"].blocks
            await published(0, 43)  # a publisher that comes back (restarted: from seq 0) is followed again
            assert index.engines["quiet"].blocks == {43}
        finally:
            await feeds.close()
            pub.close(linger=0)

    asyncio.run(run())


# -- a gateway over GPU-free engines --------------------------------------------------------


def index_view(gateway: str, ids: list[int] | None = None, salt: str | None = None) -> dict:
    body = {"token_ids": ids or [], "cache_salt": salt}
    return httpx.post(f"{gateway}/v1/engines/kv-index", json=body, timeout=30).json()["engines"]


def wait_for(condition, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)
    return found


def complete(url: str, model: str, ids: list[int], salt: str | None = None) -> int:
    """Send a prompt straight to an engine; the tokens it took from its prefix cache."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "cache_salt": salt}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def synced(gateway: str, engine_id: str, url: str, model: str) -> None:
    """Every event the engine published so far is in the gateway's index: a probe block of
    its own (a fresh salt) is stored, and waited for; events arrive in order."""
    salt, probe = uuid.uuid4().hex, [7] * (BLOCK + 1)
    complete(url, model, probe, salt)
    wait_for(lambda: (index_view(gateway, probe, salt).get(engine_id) or {}).get("cached_tokens") == BLOCK,
             f"{engine_id}'s probe block in the index")  # fmt: skip


def metric(gateway: str, name: str) -> float:
    text = httpx.get(f"{gateway}/metrics", timeout=30).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_gateways_index_predicts_what_gpu_free_engines_take_from_their_caches(tmp_path: Path):
    """A session's rounds through a real gateway over two small-cache engines (evicting):
    sampled prompts are predicted to the token; a gateway restarted while an engine stores
    catches up through replay; garbage on a registered engine's PUB socket is counted and
    skipped; an engine stopped is forgotten."""
    prefix = f"kvi-{uuid.uuid4().hex[:8]}"
    options = ("--num-blocks", "24", "--block-size", str(BLOCK), "--max-model-len", "380",
               "--enable-prompt-tokens-details", "--redis-url", REDIS_URL, "--redis-prefix", prefix)  # fmt: skip
    engines = [start_sim_worker(tmp_path, *options) for _ in range(2)]
    gateway = None
    pub = zmq.Context.instance().socket(zmq.PUB)
    try:
        gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--placement", "ampd")  # a placement that reads the index
        view = wait_for(lambda: len(v := index_view(gateway.url)) == 2 and v, "both engines followed")
        by_url = {}
        rdb = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        for worker_id in view:
            by_url[rdb.hget(f"{prefix}:worker:{worker_id}", "url")] = worker_id
        assert set(by_url) == {e.url for e in engines}
        model = engines[0].model

        rng, prompts = random.Random(11), []
        messages: list[dict] = []
        for turn in range(5):  # one session's rounds, through the gateway
            words = " ".join(rng.choice(["kv", "zmq", "alpha", "beta"]) + str(rng.randint(0, 99)) for _ in range(25))
            messages.append({"role": "user", "content": f"turn {turn}: {words}"})
            reply = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120,
                               json={"model": model, "messages": messages, "max_tokens": 8})  # fmt: skip
            assert reply.status_code == 200, reply.text
            messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
            tokenized = httpx.post(f"{engines[0].url}/tokenize", json={"model": model, "messages": messages},
                                   timeout=30).json()["tokens"]  # fmt: skip
            prompts.append(tokenized)

        predictions: list[tuple[int, int]] = []
        for engine in engines:  # sampled: the session's prompts, each predicted before it runs
            worker_id = by_url[engine.url]
            complete(engine.url, model, list(range(1000, 1000 + 20 * BLOCK)))  # evicts most of its cache
            for ids in rng.sample(prompts, 3) + [prompts[-1] + [11, 12, 13] * BLOCK]:
                synced(gateway.url, worker_id, engine.url, model)
                predicted = index_view(gateway.url, ids)[worker_id]["cached_tokens"]
                assert predicted == complete(engine.url, model, ids), (worker_id, len(ids))
                predictions.append((predicted, len(ids)))
        assert any(p > 0 for p, _ in predictions) and any(p + BLOCK < n for p, n in predictions), predictions
        assert metric(gateway.url, 'ampd_kv_index_dropped_total{reason="bound"}') == 0

        # A gateway restarted mid-run: what the engine stored meanwhile comes by replay.
        gateway.stop()
        salt, stored_meanwhile = uuid.uuid4().hex, list(range(300, 300 + 3 * BLOCK + 1))
        complete(engines[0].url, model, stored_meanwhile, salt)
        gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--placement", "ampd")
        wait_for(lambda: (index_view(gateway.url, stored_meanwhile, salt).get(by_url[engines[0].url]) or {})
                 .get("cached_tokens") == 3 * BLOCK, "the restarted gateway's index to hold the blocks")  # fmt: skip

        # Garbage on a registered engine's socket: counted, skipped, and the feed goes on.
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        fake = WorkerInfo("fake-engine", "decode", engines[0].url, "fake-model", load_profile(DEFAULT_PROFILE),
                          kv_events=f"tcp://127.0.0.1:{port}", kv_hash_algo="sha256",
                          kv_hash_seed=wire.DEFAULT_SEED)  # fmt: skip

        async def register_fake() -> None:
            async with aioredis.from_url(REDIS_URL, decode_responses=True) as r:
                await register(r, prefix, fake, ttl_s=600)

        asyncio.run(register_fake())
        wait_for(lambda: "fake-engine" in index_view(gateway.url), "the fake engine followed")
        good = wire.encode_batch(batch(stored([42])))

        def fed() -> bool:  # PUB drops what it sends before the subscription lands: send until seen
            pub.send_multipart([b"", b"\x00\x01", b"garbage"])
            pub.send_multipart([b"", wire.seq_bytes(0), b"\xc1not msgpack"])
            pub.send_multipart(wire.published_frames(b"", 0, good))
            return index_view(gateway.url)["fake-engine"]["blocks"] == 1

        wait_for(fed, "a good batch after garbage")
        assert metric(gateway.url, "ampd_kv_events_malformed_total") >= 2

        stop(engines[1])  # an engine that leaves is forgotten
        wait_for(lambda: by_url[engines[1].url] not in index_view(gateway.url), "the stopped engine forgotten")
    finally:
        pub.close(linger=0)
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            stop(engine)
        delete_prefix(REDIS_URL, prefix)


@contextlib.contextmanager
def placing(tmp: Path, engines: int, placement: str, *engine_options: str) -> Iterator[tuple[Child, dict[str, str]]]:
    """GPU-free engines (``--role both``) behind a gateway placing by ``placement``, its KV
    index following every engine: the gateway, and the engines' URLs by worker id."""
    prefix = f"kvp-{uuid.uuid4().hex[:8]}"
    options = ("--num-blocks", "512", "--block-size", str(BLOCK), "--max-model-len", "4096",
               "--enable-prompt-tokens-details", "--redis-url", REDIS_URL, "--redis-prefix", prefix,
               *engine_options)  # fmt: skip
    started = [start_sim_worker(tmp, *options) for _ in range(engines)]
    gateway = None
    try:
        gateway = start_gateway(tmp, REDIS_URL, prefix, "--placement", placement, "--policy", "coloc")
        view = wait_for(lambda: len(v := index_view(gateway.url)) == engines and v, "every engine followed")
        rdb = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        yield gateway, {w: rdb.hget(f"{prefix}:worker:{w}", "url") for w in view}
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in started:
            stop(engine)
        delete_prefix(REDIS_URL, prefix)


def test_a_gateway_placing_by_the_index_binds_new_sessions_where_their_agents_prompt_is_cached(tmp_path: Path):
    """``--placement ampd`` over two GPU-free engines: each holds one agent's long system
    prompt (put there straight, not through the gateway, so nothing else says where it
    is); every new session of an agent is bound to the engine that caches its prompt, and
    its first prompt is taken from that cache. Only the KV index knows: both engines are
    equally loaded, and the sessions are new."""
    with placing(tmp_path, 2, "ampd") as (gateway, urls):
        by_url = {url: w for w, url in urls.items()}
        engines = list(urls.values())
        model = httpx.get(f"{engines[0]}/v1/models").json()["data"][0]["id"]
        rng = random.Random(5)
        agents = [" ".join(f"{name}{rng.randint(0, 999)}" for _ in range(300)) for name in ("plan", "code")]
        for url, system in zip(engines, agents, strict=True):  # each engine caches one agent's prompt
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
                "max_tokens": 1})  # fmt: skip
            assert reply.status_code == 200, reply.text
            synced(gateway.url, by_url[url], url, model)
        for k in range(4):
            agent = k % 2
            messages = [{"role": "system", "content": agents[agent]}, {"role": "user", "content": f"task {k}"}]
            reply = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120,
                               json={"model": model, "messages": messages, "max_tokens": 4})  # fmt: skip
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-ampd-decode-worker"] == by_url[engines[agent]], (k, reply.headers)
            cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 250, (k, cached)  # the system prompt's blocks came from the cache
