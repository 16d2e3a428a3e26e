"""Bindings that outlive gateways and workers, static configuration, back-pressure."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from ampd.local_redis import free_port
from ampd.processes import spawn_gateway, wait_healthy
from tests.engines import start_gateway, start_sim_worker, stop
from tests.test_gateway import MODEL, REDIS_URL

BODY = {"model": MODEL, "max_tokens": 4}


def ask(url: str, session_id: str, content: str) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    response = httpx.post(f"{url}/v1/chat/completions", json={**BODY, "messages": messages}, timeout=60,
                          headers={"X-Session-Id": session_id})  # fmt: skip
    assert response.status_code == 200, response.text
    return response


def cleanup(prefix: str) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=f"{prefix}:*"))
    if keys:
        r.delete(*keys)


def test_binding_survives_a_gateway_restart_and_moves_off_a_dead_worker(tmp_path):
    prefix = f"res-{uuid.uuid4().hex[:8]}"
    registry = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "20")
    decoders = [start_sim_worker(tmp_path, "--role", "decode", *registry) for _ in range(2)]
    gateway = start_gateway(tmp_path, REDIS_URL, prefix)
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        bound = ask(gateway.url, "s1", "first round").headers["x-ampd-route"].split(":", 1)[1]
        gateway.stop()
        gateway = start_gateway(tmp_path, REDIS_URL, prefix)  # a new process: only Redis remembers
        assert ask(gateway.url, "s1", "second round").headers["x-ampd-route"].split(":", 1)[1] == bound
        assert store.hget(f"{prefix}:session:public:s1", "rounds") == "2"

        victim = next(d for d in decoders if d.url.endswith(bound.rsplit(":", 1)[1]))
        stop(victim)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the pool drops it at its next failed scrape
            response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, headers={"X-Session-Id": "s1"},
                                  json={**BODY, "messages": [{"role": "user", "content": "third round"}]})  # fmt: skip
            if response.status_code == 200:
                break
            time.sleep(0.3)
        assert response.status_code == 200
        moved = response.headers["x-ampd-route"].split(":", 1)[1]
        assert moved != bound
        record = store.hgetall(f"{prefix}:session:public:s1")
        assert record["decode_worker"] == moved and record["rounds"] == "3"
        # The new worker prefilled the whole history: what it holds is this round only.
        assert int(record["l_hist"]) == response.json()["usage"]["total_tokens"]
    finally:
        gateway.stop()
        for d in decoders:
            stop(d)
        cleanup(prefix)


def test_statically_configured_workers_need_no_registry(tmp_path):
    worker = start_sim_worker(tmp_path, "--role", "both", "--speed", "20")
    port = free_port()
    options = ["--redis-url", REDIS_URL, "--redis-prefix", f"static-{uuid.uuid4().hex[:6]}",
               "--worker", f"both={worker.url}@llama-3.1-8b_h100_tp1@20"]  # fmt: skip
    gateway = spawn_gateway("static", port, options, log=tmp_path / "static.log")
    try:
        assert wait_healthy([gateway], 30, path="/readyz") is None
        response = ask(gateway.url, "st", "hello")
        assert response.headers["x-ampd-route"] == f"local:{worker.url}"
        assert httpx.get(f"{gateway.url}/v1/models").json()["data"][0]["id"] == MODEL
    finally:
        gateway.stop()
        stop(worker)


def test_a_full_prefill_queue_answers_429(tmp_path):
    prefix = f"full-{uuid.uuid4().hex[:8]}"
    worker = start_sim_worker(tmp_path, "--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", prefix)
    gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--max-queue", "1")
    long_prompt = "many words in this prompt " * 3000  # ~15k tokens: a slow prefill at speed 1

    def one(i: int) -> httpx.Response:
        return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120,
                          json={**BODY, "messages": [{"role": "user", "content": f"{i} {long_prompt}"}]})  # fmt: skip

    try:
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(one, range(6)))
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses, statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.json()["error"]["code"] == "queue_full" and refused.headers["retry-after"] == "1"
    finally:
        gateway.stop()
        stop(worker)
        cleanup(prefix)
