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

from gateway.config import GatewayConfig
from gateway.engines.step_targets import wanted_ms
from surface.registry import WorkerInfo
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
    """The CLI piped, as a script reads it (no COLUMNS: its tables must not be cut to 80 columns)."""
    piped = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "ampd.cli", *args], capture_output=True, text=True, timeout=60,
                          env=piped)  # fmt: skip


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
        assert listed.returncode == 0 and "as registered" in listed.stdout
        row = next(line for line in listed.stdout.splitlines() if home in line)  # the whole row on one line
        assert "as registered" in row and "http://127.0.0.1:" in row and MODEL in row, listed.stdout

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


def test_a_gateway_that_sizes_steps_hands_each_engine_its_target_and_keeps_it(tmp_path):
    """``dynaserve`` under the P95 rule: every engine is kept to the target its SLO gives,
    through the registry and without a restart; a role move keeps it, an operator's other
    target is put back, and a gateway under the mean rule assigns none."""
    prefix = f"roles-{uuid.uuid4().hex[:8]}"
    registry = ("--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "20")
    engines = [start_sim_worker(tmp_path, *registry) for _ in range(2)]
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    redis_options = ("--redis-url", REDIS_URL, "--redis-prefix", prefix)
    mean_rule = start_gateway(tmp_path, REDIS_URL, prefix, "--policy", "dynaserve")
    gateway = None
    try:
        ask(mean_rule.url, "s0", "hello")
        assert all(target_s(e) == 0.0 for e in engines)
        assert not any(store.hexists(f"{prefix}:role:{worker_id(e)}", "step_target_ms") for e in engines)
        mean_rule.stop()

        gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--policy", "dynaserve", "--itl-slo-metric", "p95")
        config = GatewayConfig(policy="dynaserve", itl_slo_metric="p95")
        info = WorkerInfo.from_redis(store.hgetall(f"{prefix}:worker:{worker_id(engines[0])}"))
        wanted = wanted_ms(config, info)
        assert wanted > 0
        for e in engines:
            until(lambda e=e: target_s(e) == wanted / 1000, what="the engine to take the gateway's target")
        assert ask(gateway.url, "s1", HISTORY).status_code == 200

        moved = worker_id(engines[0])
        assert ampd("workers", "set", moved, "prefill", *redis_options).returncode == 0
        assert ampd("workers", "step-target", moved, "5", *redis_options).returncode == 0  # wrote 5.0
        held = lambda: float(store.hget(f"{prefix}:role:{moved}", "step_target_ms"))  # noqa: E731
        until(lambda: held() == wanted, what="the gateway to put its target back")
        assert store.hget(f"{prefix}:role:{moved}", "role") == "prefill"
        until(lambda: target_s(engines[0]) == wanted / 1000, what="the engine to keep the gateway's target")
    finally:
        for child in (mean_rule, gateway):
            if child is not None:
                child.stop()
        for e in engines:
            stop(e)
        cleanup(prefix)


def target_s(engine: Engine) -> float:
    return engine.metrics()["ampd:step_target_seconds"]


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
