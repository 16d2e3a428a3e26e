"""Faults, for real: workers SIGKILLed mid-stream and mid-queue, clients hanging up.

Real Redis, GPU-free workers and a gateway in subprocesses. The workers run slowly
(speed 0.25) so that a 120-token reply is still streaming when its worker dies.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ampd.local_redis import free_port, server_binary, start_private_redis
from tests.engines import Engine, start_gateway, start_sim_worker, stop
from tests.test_gateway import MODEL, REDIS_URL
from tests.test_gateway_resilience import cleanup

TOKENS = 120
KILL_AFTER = 30  # content chunks the client has when its decode worker is killed


def request(content: str, seed: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "seed": seed,
            "max_tokens": TOKENS, "ignore_eos": True}  # fmt: skip


def stream(
    url: str,
    session_id: str,
    body: dict,
    after: Callable[[str], None] | None = None,
    started: threading.Event | None = None,
) -> list[dict | str]:
    """Every SSE payload of a streamed chat completion. ``after`` is called with the
    session's decode worker once KILL_AFTER content chunks have arrived, while the
    stream is open; ``started`` is set at the first chunk."""
    events: list[dict | str] = []
    contents = 0
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": session_id},
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if started is not None:
                started.set()
            if isinstance(events[-1], dict) and any(c["delta"].get("content") for c in events[-1].get("choices", [])):
                contents += 1
                if contents == KILL_AFTER and after is not None:
                    after(response.headers["x-ampd-decode-worker"])
    return events


def text_of(events: list[dict | str]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events if isinstance(e, dict) for c in e.get("choices", []))


def worker_of(decoders: list[Engine], worker_id: str) -> Engine:
    return next(d for d in decoders if d.url.endswith(worker_id.rsplit(":", 1)[1]))


def migrations(gateway_url: str) -> dict[str, float]:
    text = httpx.get(f"{gateway_url}/metrics").text
    samples = [s for f in text_string_to_metric_families(text) if f.name == "ampd_migrations" for s in f.samples]
    return {s.labels["outcome"]: s.value for s in samples if s.name.endswith("_total")}


@pytest.fixture
def cluster(tmp_path):
    prefix = f"mig-{uuid.uuid4().hex[:8]}"
    registry = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "0.25")
    prefill = start_sim_worker(tmp_path, "--role", "prefill", *registry)
    decoders = [start_sim_worker(tmp_path, "--role", "decode", *registry) for _ in range(2)]
    yield tmp_path, prefix, prefill, decoders
    for engine in (prefill, *decoders):
        stop(engine)
    cleanup(prefix)


def test_a_stream_moves_off_a_killed_decode_worker_without_losing_a_token(cluster):
    tmp, prefix, prefill, decoders = cluster
    first = request(f"Tell me a long story {uuid.uuid4().hex}.", seed=11)
    other = request(f"Another session {uuid.uuid4().hex}.", seed=12)
    # The undisturbed replies (the engine is deterministic for a given seed), asked for
    # before the gateway starts so that its first look at the workers finds them idle.
    with ThreadPoolExecutor(2) as pool:
        url = f"{prefill.url}/v1/chat/completions"
        asked = [pool.submit(httpx.post, url, json=body, timeout=120) for body in (first, other)]
        expected, expected_other = (f.result().json() for f in asked)
    gateway = start_gateway(tmp, REDIS_URL, prefix)
    try:
        bound: dict[str, str] = {}

        def kill(worker_id: str) -> None:
            bound["victim"] = worker_id
            worker_of(decoders, worker_id).child.process.kill()

        # Two sessions at once on different decode workers (the second binds away from the
        # first's load); only the moving session's worker dies.
        results: dict[str, list] = {}
        running = threading.Event()
        bystander = threading.Thread(
            target=lambda: results.update(other=stream(gateway.url, "bystander", other, started=running))
        )
        bystander.start()
        assert running.wait(30)
        events = stream(gateway.url, "moving", first, after=kill)
        bystander.join()

        chunks = [e for e in events if isinstance(e, dict)]
        assert events[-1] == "[DONE]" and not any("error" in e for e in chunks), events[-3:]
        assert {e["id"] for e in chunks} == {chunks[0]["id"]}  # one completion, one id
        assert sum("role" in c["delta"] for e in chunks for c in e["choices"]) == 1
        assert text_of(events) == expected["choices"][0]["message"]["content"]  # nothing lost or repeated
        finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c.get("finish_reason")]
        assert finishes == ["length"]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == TOKENS
        assert usage["prompt_tokens"] == expected["usage"]["prompt_tokens"]

        rounds = httpx.get(f"{gateway.url}/v1/sessions/moving").json()["rounds"]
        survivor = rounds[0]["decode_worker"]
        assert rounds[0]["migrations"] == 1 and survivor != bound["victim"]
        assert migrations(gateway.url) == {"moved": 1.0, "refused": 0.0}

        # The bystander, bound to the surviving worker, never noticed.
        assert text_of(results["other"]) == expected_other["choices"][0]["message"]["content"]
        untouched = httpx.get(f"{gateway.url}/v1/sessions/bystander").json()["rounds"][0]
        assert untouched["decode_worker"] == survivor and untouched["migrations"] == 0

        # The next round runs on the new worker, which holds the whole history.
        history = [*first["messages"], {"role": "assistant", "content": text_of(events)},
                   {"role": "user", "content": "And then?"}]  # fmt: skip
        follow_up = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"X-Session-Id": "moving"},
                               json={"model": MODEL, "messages": history, "max_tokens": 4}, timeout=60)  # fmt: skip
        assert follow_up.status_code == 200, follow_up.text
        second = httpx.get(f"{gateway.url}/v1/sessions/moving").json()["rounds"][1]
        assert second["decode_worker"] == survivor and second["kind"] == "incremental"
        assert second["l_hist"] == usage["total_tokens"]
    finally:
        gateway.stop()


def test_past_the_migration_limit_the_stream_ends_with_a_clean_error(cluster):
    tmp, prefix, _, decoders = cluster
    gateway = start_gateway(tmp, REDIS_URL, prefix, "--migration-limit", "0")
    try:

        def kill(worker_id: str) -> None:
            worker_of(decoders, worker_id).child.process.kill()

        events = stream(gateway.url, "stuck", request(f"Hello {uuid.uuid4().hex}", seed=3), after=kill)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "upstream_error" and error["code"] == "upstream_error"
        assert "migration limit 0" in error["message"]
        assert len(text_of(events)) > 0
        assert migrations(gateway.url) == {"moved": 0.0, "refused": 1.0}

        # A Messages stream ends as Anthropic's API ends one: an error event, in-band.
        body = {"model": MODEL, "max_tokens": TOKENS, "stream": True, "ignore_eos": True, "seed": 4,
                "messages": [{"role": "user", "content": f"Hello {uuid.uuid4().hex}"}]}  # fmt: skip
        types, deltas = [], 0
        with httpx.stream("POST", f"{gateway.url}/v1/messages", json=body, headers={"X-Session-Id": "stuck-too"},
                          timeout=120) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    types.append(event["type"])
                    deltas += event["type"] == "content_block_delta"
                    if deltas == KILL_AFTER and event["type"] == "content_block_delta":
                        kill(response.headers["x-ampd-decode-worker"])
        assert types[0] == "message_start" and types[-1] == "error" and "message_stop" not in types, types[-3:]
        assert deltas >= KILL_AFTER and event["error"]["type"] == "api_error", event
        assert "migration limit 0" in event["error"]["message"]
        assert migrations(gateway.url) == {"moved": 0.0, "refused": 2.0}
    finally:
        gateway.stop()


def test_a_killed_prefill_worker_loses_no_queued_task(tmp_path):
    """Four long first rounds queue for one prefill worker (one slot); it is killed while
    prefilling the first. Every round still answers, prefilled on its decode worker, once."""
    prefix = f"pkill-{uuid.uuid4().hex[:8]}"
    registry = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "0.05")
    prefill = start_sim_worker(tmp_path, "--role", "prefill", *registry)
    decode = start_sim_worker(tmp_path, "--role", "decode", *registry[:-1], "2")
    gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--policy", "disagg")
    long_prompt = "words that take a while to prefill " * 400

    def one(i: int) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": f"{i} {long_prompt}"}]}
        return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"X-Session-Id": f"q{i}"},
                          timeout=120)  # fmt: skip

    try:
        with ThreadPoolExecutor(4) as pool:
            replies = [pool.submit(one, i) for i in range(4)]
            deadline = time.monotonic() + 30
            while prefill.metrics().get("vllm:num_requests_running", 0) < 1:  # the first is prefilling
                assert time.monotonic() < deadline
                time.sleep(0.05)
            prefill.child.process.kill()
            responses = [r.result() for r in replies]
        assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
        for i in range(4):
            rounds = httpx.get(f"{gateway.url}/v1/sessions/q{i}").json()["rounds"]
            assert len(rounds) == 1 and rounds[0]["route"] == "local", rounds
        assert decode.metrics()['vllm:request_success_total{"finished_reason": "length"}'] == 4  # none twice
    finally:
        gateway.stop()
        stop(decode)
        stop(prefill)
        cleanup(prefix)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_client_leaving_mid_stream_aborts_the_engine_request(cluster, path):
    """The client hangs up after a few chunks: the decode worker stops generating and frees
    the request's KV, and the gateway's prefill queue is free for the next round. Chat
    completions are served off FastAPI's routing (gateway.apis.app.HotPath), the Messages API
    through it: both streams notice the hang-up the same way."""
    tmp, prefix, _, decoders = cluster
    gateway = start_gateway(tmp, REDIS_URL, prefix)
    try:
        body = dict(request(f"Leave early {uuid.uuid4().hex}", seed=5), max_tokens=2000, stream=True)
        with httpx.stream("POST", f"{gateway.url}{path}", json=body, timeout=60) as response:
            worker = worker_of(decoders, response.headers["x-ampd-decode-worker"])
            lines = response.iter_lines()
            for _ in range(10):
                next(lines)
            assert worker.metrics()["vllm:num_requests_running"] == 1
        deadline = time.monotonic() + 10
        while worker.metrics()["vllm:num_requests_running"] > 0:
            assert time.monotonic() < deadline, "the engine request was not aborted"
            time.sleep(0.1)
        assert worker.metrics()["vllm:kv_cache_usage_perc"] == 0.0  # its blocks are free (cached at most)
        again = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                           json=dict(request("next", seed=6), max_tokens=4))  # fmt: skip
        assert again.status_code == 200, again.text
    finally:
        gateway.stop()


def test_the_gateway_serves_through_a_redis_restart(tmp_path):
    """Redis is killed under load and comes back empty. Meanwhile every round is answered,
    each session stays on its decode worker, new sessions are bound, and the outage
    shows in /readyz and /metrics; afterwards the workers' heartbeats rebuild the
    registry and the shared state fills again."""
    binary = server_binary()
    assert binary is not None, "redis-server is needed (make installs it)"
    port = free_port()
    server = start_private_redis(binary, port, tmp_path)
    registry = ("--redis-url", server.url, "--redis-prefix", "outage", "--speed", "20")
    workers = [start_sim_worker(tmp_path, "--role", role, *registry) for role in ("prefill", "decode", "decode")]
    gateway = start_gateway(tmp_path, server.url, "outage")
    answers: dict[str, list[tuple[float, int, str]]] = {f"s{i}": [] for i in range(4)}
    done = threading.Event()

    def converse(session_id: str) -> None:
        messages: list[dict] = []
        while not done.is_set():
            messages.append({"role": "user", "content": f"{session_id} round {len(messages)}"})
            response = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"X-Session-Id": session_id},
                                  json={"model": MODEL, "messages": messages, "max_tokens": 4}, timeout=60)  # fmt: skip
            worker = response.headers.get("x-ampd-decode-worker", "")
            answers[session_id].append((time.monotonic(), response.status_code, worker))
            if response.status_code != 200:
                return
            messages.append(response.json()["choices"][0]["message"])
            time.sleep(0.05)

    def metric(name: str) -> float:
        text = httpx.get(f"{gateway.url}/metrics").text
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    threads = [threading.Thread(target=converse, args=(s,)) for s in answers]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        server.process.kill()
        server.process.wait()
        down_at = time.monotonic()
        time.sleep(1.5)
        ready = httpx.get(f"{gateway.url}/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded", ready.text
        assert metric("ampd_redis_up") == 0.0
        hello = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        new = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"X-Session-Id": "newcomer"}, json=hello)
        assert new.status_code == 200, new.text
        time.sleep(1.5)
        server = start_private_redis(binary, port, tmp_path)  # empty: it keeps nothing on disk
        up_at = time.monotonic()
        deadline = up_at + 15
        while httpx.get(f"{gateway.url}/readyz").json()["status"] != "ready":
            assert time.monotonic() < deadline, "the gateway never saw Redis again"
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while metric("ampd_redis_up") != 1.0:  # a pooled connection from before the restart may fail once more
            assert time.monotonic() < deadline, "ampd_redis_up stayed 0"
            time.sleep(0.2)
        time.sleep(1.0)
        assert httpx.get(f"{gateway.url}/v1/sessions/s0").status_code == 200  # written again
    finally:
        done.set()
        for t in threads:
            t.join()
        gateway.stop()
        for w in workers:
            stop(w)
        server.stop()
    for session_id, rounds in answers.items():
        assert [status for _, status, _ in rounds] == [200] * len(rounds), (session_id, rounds[-1])
        assert len({worker for _, _, worker in rounds}) == 1, session_id  # never re-bound
        assert any(down_at < at < up_at for at, _, _ in rounds), session_id  # served during the outage


def test_a_killed_gateway_replica_leaves_its_sessions_to_the_other(cluster):
    """Two replicas share Redis; one is SIGKILLed after a session's first round. The
    other serves the next round on the same decode worker, as an incremental prefill."""
    tmp, prefix, _, _ = cluster
    doomed, other = (start_gateway(tmp, REDIS_URL, prefix) for _ in range(2))
    try:
        messages = [{"role": "user", "content": f"Hello {uuid.uuid4().hex}"}]
        body = {"model": MODEL, "max_tokens": 4}
        first = httpx.post(f"{doomed.url}/v1/chat/completions", json={**body, "messages": messages}, timeout=60,
                           headers={"X-Session-Id": "orphan"})  # fmt: skip
        assert first.status_code == 200, first.text
        doomed.process.kill()
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        second = httpx.post(f"{other.url}/v1/chat/completions", json={**body, "messages": messages}, timeout=60,
                            headers={"X-Session-Id": "orphan"})  # fmt: skip
        assert second.status_code == 200, second.text
        assert second.headers["x-ampd-decode-worker"] == first.headers["x-ampd-decode-worker"]
        rounds = httpx.get(f"{other.url}/v1/sessions/orphan").json()["rounds"]
        assert [r["kind"] for r in rounds] == ["initial", "incremental"]
        assert rounds[1]["l_hist"] == first.json()["usage"]["total_tokens"]
    finally:
        doomed.stop()
        other.stop()


def test_new_sessions_right_after_a_decode_worker_dies_go_to_the_survivor(cluster):
    """The gateway has not scraped the dead worker yet: counting a prompt there or binding
    to it fails, so the worker is left out and the next one asked; no request fails."""
    tmp, prefix, _, decoders = cluster
    gateway = start_gateway(tmp, REDIS_URL, prefix, "--policy", "coloc")
    try:
        victim, survivor = decoders
        victim.child.process.kill()
        victim.child.process.wait()
        with ThreadPoolExecutor(4) as pool:
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": f"new {i}"}], "max_tokens": 2}
                      for i in range(4)]  # fmt: skip
            answers = list(pool.map(lambda b: httpx.post(f"{gateway.url}/v1/chat/completions", json=b, timeout=60),
                                    bodies))  # fmt: skip
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert {a.headers["x-ampd-decode-worker"].rsplit(":", 1)[1] for a in answers} == {survivor.url.rsplit(":")[-1]}
    finally:
        gateway.stop()
