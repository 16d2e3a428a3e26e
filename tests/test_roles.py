"""Engine roles live: set by an operator or by the elastic controller, applied by every
gateway with no restart, and a session whose engine stops decoding keeps its KV."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import redis

from tests.engines import Engine, start_gateway, start_sim_worker, stop
from tests.test_gateway import MODEL, REDIS_URL
from tests.test_gateway_resilience import cleanup

HISTORY = "The agent reads a long manual before it acts. " * 60  # ~540 tokens of history


def ask(url: str, session_id: str, content: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": session_id}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def ampd(*args: str) -> subprocess.CompletedProcess:
    wide = {**os.environ, "COLUMNS": "240"}  # one table row per line
    return subprocess.run([sys.executable, "-m", "ampd.cli", *args], capture_output=True, text=True, timeout=60,
                          env=wide)  # fmt: skip


def worker_id(engine: Engine) -> str:
    return f"sim-both-127.0.0.1:{engine.url.rsplit(':', 1)[1]}"


def until(condition, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.2)


def test_an_engine_moves_to_prefill_and_its_sessions_reach_their_kv_there(tmp_path):
    prefix = f"roles-{uuid.uuid4().hex[:8]}"
    registry = ("--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "20")
    engines = [start_sim_worker(tmp_path, *registry) for _ in range(2)]
    gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--policy", "ampd")
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    redis_options = ("--redis-url", REDIS_URL, "--redis-prefix", prefix)
    try:
        first = ask(gateway.url, "s1", HISTORY)
        home = first.headers["x-ampd-decode-worker"]
        moving = next(e for e in engines if worker_id(e) == home)
        staying = next(e for e in engines if e is not moving)
        listed = ampd("workers", *redis_options)
        assert listed.returncode == 0 and home in listed.stdout and "as registered" in listed.stdout

        done = ampd("workers", "set", home, "prefill", *redis_options)
        assert done.returncode == 0 and f"{home}: prefill (P)" in done.stdout, done.stdout + done.stderr
        metric = f'ampd_worker_role{{role="prefill",worker="{home}"}} 1.0'
        until(lambda: metric in httpx.get(f"{gateway.url}/metrics").text, what="the gateway to apply the role")

        pulled_before = staying.metrics()["vllm:nixl_bytes_transferred_sum"]
        second = ask(gateway.url, "s1", HISTORY + " Now act.")  # s1's next round: it moves to the other engine
        assert second.headers["x-ampd-decode-worker"] == worker_id(staying)
        assert second.headers["x-ampd-route"] == f"remote:{home}"  # prefilled where its history is cached
        session = store.hgetall(f"{prefix}:session:public:s1")
        assert session["decode_worker"] == worker_id(staying) and session["rounds"] == "2"
        record = httpx.get(f"{gateway.url}/v1/sessions/s1").json()["rounds"][-1]
        assert record["route"] == "remote" and record["prefill_worker"] == home
        pulled = staying.metrics()["vllm:nixl_bytes_transferred_sum"] - pulled_before
        assert pulled > 0  # the whole history came over, not recomputed
        # A new session binds only to the engine that still decodes.
        assert ask(gateway.url, "s2", "hello").headers["x-ampd-decode-worker"] == worker_id(staying)

        # A step target beside the role (what a vLLM engine's supervisor follows), kept by role moves.
        target = ampd("workers", "step-target", home, "42.5", *redis_options)
        assert target.returncode == 0 and f"{home}: step target 42.5 ms" in target.stdout, target.stdout + target.stderr
        assert ampd("workers", "set", home, "decode", *redis_options).returncode == 0
        assert store.hgetall(f"{prefix}:role:{home}") | {"since": ""} == {"role": "decode", "step_target_ms": "42.5",
                                                                           "since": "", "draining": ""}  # fmt: skip
        refused = ampd("workers", "step-target", "nobody", "10", *redis_options)
        assert refused.returncode != 0 and "no engine 'nobody'" in refused.stdout

        wrong = ampd("workers", "set", home, "cook", *redis_options)
        assert wrong.returncode != 0 and "role must be one of" in wrong.stdout + wrong.stderr
        missing = ampd("workers", "set", "nobody", "decode", *redis_options)
        assert missing.returncode != 0 and "no engine 'nobody'" in missing.stdout
    finally:
        gateway.stop()
        for e in engines:
            stop(e)
        cleanup(prefix)


def test_the_elastic_controller_moves_an_engine_under_prefill_pressure(tmp_path):
    """Every round misses a 1 ms TTFT threshold while decode idles (a 10 s ITL threshold):
    Arrow's Alg. 3 lends a decode engine to prefill, and the move is in Redis and /metrics."""
    prefix = f"elastic-{uuid.uuid4().hex[:8]}"
    registry = ("--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "20")
    engines = [start_sim_worker(tmp_path, *registry) for _ in range(2)]
    gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--policy", "elastic", "--ttft-slo", "0.001",
                            "--itl-slo", "10")  # fmt: skip
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        ask(gateway.url, "e1", "warm up")

        def roles() -> list[str | None]:
            return [store.hget(f"{prefix}:role:{worker_id(e)}", "role") for e in engines]

        until(lambda: "prefill" in roles(), what="the controller's move")
        assigned = roles()  # the other keeps decoding: as registered, or told so
        assert assigned.count("prefill") == 1 and set(assigned) - {"prefill"} <= {None, "decode"}, assigned
        assert 'ampd_role_moves_total{reason="prefill-slo"} 1.0' in httpx.get(f"{gateway.url}/metrics").text
        assert ask(gateway.url, "e2", "after the move").status_code == 200
    finally:
        gateway.stop()
        for e in engines:
            stop(e)
        cleanup(prefix)
