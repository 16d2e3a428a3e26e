"""Per-round spans and metrics from a real multi-round session.

The gateway runs in this process (uvicorn in a thread) so the SDK's in-memory exporter
sees its spans; the workers are real GPU-free engines in subprocesses, Redis is real.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ampd.local_redis import free_port
from gateway.apis.app import create_app
from gateway.config import GatewayConfig
from tests.engines import start_sim_worker, stop

REDIS_URL = "redis://127.0.0.1:6379/13"
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
          "properties": {"q": {"type": "string"}}, "required": ["q"]}}}  # fmt: skip
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)  # once per process; the gateway's tracer resolves to it
    tmp = tmp_path_factory.mktemp("tracing")
    prefix = f"trace-{uuid.uuid4().hex[:8]}"
    registry = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "2")
    workers = [start_sim_worker(tmp, "--role", role, *registry) for role in ("prefill", "decode")]
    config = GatewayConfig(redis_url=REDIS_URL, key_prefix=prefix, policy="disagg", access_log=str(tmp / "access.log"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "in-process gateway not ready"
        time.sleep(0.1)
    yield url
    server.should_exit = True
    thread.join(timeout=10)
    for w in workers:
        stop(w)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_session_is_one_trace_with_a_span_per_round_and_phase(gateway):
    session_id = f"traced-{uuid.uuid4().hex[:6]}"
    script = {"rounds": [{"output_tokens": 12, "tool_calls": [{"name": "search", "arguments": {"q": "a"}}]},
                         {"output_tokens": 12, "tool_calls": [{"name": "search", "arguments": {"q": "b"}}]},
                         {"output_tokens": 12}]}  # fmt: skip
    canary = f"canary-{uuid.uuid4().hex}"
    messages: list = [{"role": "user", "content": f"Find {canary} " * 50}]
    before = metric(gateway, 'ampd_ttft_seconds_count{kind="incremental"}')
    completion_tokens: list[int] = []
    with httpx.Client(timeout=60, headers={"X-Session-Id": session_id}) as client:
        for _ in range(3):
            body = {"messages": messages, "tools": [SEARCH], "sim_script": script}
            reply = client.post(f"{gateway}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            completion_tokens.append(reply.json()["usage"]["completion_tokens"])
            messages.append({k: v for k, v in message.items() if v is not None})
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found " * 30})
    spans = [s for s in EXPORTER.get_finished_spans() if s.attributes.get("ampd.session.id") == session_id]
    (session,) = [s for s in spans if s.name == "session"]
    rounds = sorted((s for s in spans if s.name == "round"), key=lambda s: s.attributes["ampd.round"])
    assert [r.attributes["ampd.kind"] for r in rounds] == ["initial", "incremental", "incremental"]
    for r, tokens in zip(rounds, completion_tokens, strict=True):  # each in the session's trace, under its span
        assert r.context.trace_id == session.context.trace_id
        assert r.parent.span_id == session.context.span_id
        children = {s.name: s for s in EXPORTER.get_finished_spans()
                    if s.parent is not None and s.parent.span_id == r.context.span_id}  # fmt: skip
        assert set(children) == {"queue_wait", "prefill", "kv_transfer", "decode"}  # disagg: all remote
        prefill, decode = children["prefill"], children["decode"]
        assert prefill.attributes["ampd.route"] == "remote"
        assert prefill.attributes["ampd.l_hist"] + prefill.attributes["ampd.l_incr"] > 100
        assert decode.attributes["ampd.tokens"] == tokens
        assert 0 < decode.attributes["ampd.itl_mean_s"] <= decode.attributes["ampd.itl_p95_s"]
        assert r.start_time <= children["queue_wait"].start_time <= prefill.start_time
        assert (
            prefill.end_time <= children["kv_transfer"].end_time <= decode.start_time <= decode.end_time <= r.end_time
        )
    assert rounds[2].attributes["ampd.route"] == "remote"
    assert not [s.name for s in EXPORTER.get_finished_spans() if canary in str(dict(s.attributes))]  # no prompt text
    assert metric(gateway, 'ampd_ttft_seconds_count{kind="incremental"}') == before + 2
    assert metric(gateway, 'ampd_route_total{reason="policy",route="remote"}') >= 3
