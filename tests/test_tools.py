"""Server-side tools: the tools themselves, the sandbox under attack, rq, and the gateway's loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import redis
from anthropic.types.beta import BetaMCPToolResultBlock, BetaMCPToolUseBlock, BetaTextBlock
from openai.types.responses.response_output_item import McpCall

from tests.engines import Engine, kill_group, sse_events, start_gateway, start_sim_worker, start_tools_worker, stop
from tests.test_gateway import MODEL, REDIS_URL
from tools_sandbox.calculator import CalculatorError, evaluate
from tools_sandbox.client import ToolRunner
from tools_sandbox.python_tool import Limits, isolation, run_python
from tools_sandbox.registry import TOOLS, execute, openai_tool
from tools_sandbox.retrieval import retrieve

SECRET = "ampd-secret-" + uuid.uuid4().hex
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


# -- the tools ----------------------------------------------------------------------


def test_tool_schemas_are_openai_functions():
    schema = openai_tool(TOOLS["retrieve"])
    assert schema["type"] == "function" and schema["function"]["name"] == "retrieve"
    assert schema["function"]["parameters"]["required"] == ["query"]
    assert "invalid arguments" in execute("calculator", json.dumps({"expr": "1"})).content
    assert not execute("nope", "{}").ok


def test_calculator_is_arithmetic_only():
    assert evaluate("(2 + 3) * sqrt(16) - 2**10 // 3") == 20 - 341
    assert evaluate("-pi") == pytest.approx(-3.14159, abs=1e-5)
    for hostile in ("__import__('os').system('id')", "(1).__class__", "9**9**9", "[1]*10", "1/0", "x"):
        with pytest.raises(CalculatorError):
            evaluate(hostile)


def test_retrieve_ranks_the_shipped_corpus_and_an_operators_folder(tmp_path):
    assert retrieve("how are KV cache blocks read with NIXL", 1)[0].source == "nixl.md"
    assert retrieve("the of and", 3) == []
    (tmp_path / "notes.txt").write_text("Zebras sleep standing up.\n\nPenguins cannot fly but swim fast.")
    found = retrieve("can penguins fly", 1, folder=tmp_path)
    assert found[0].text.startswith("Penguins") and found[0].source == "notes.txt"


# -- the sandbox, attacked through a real rq worker ------------------------------------

HOSTILE = {
    "open a socket": ("import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=2)", "exited with status"),
    "write outside scratch": ("open('{target}', 'w').write('pwned')", "Read-only file system"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "exited with status"),
    "memory bomb": ("x = bytearray(8 * 2**30)", "MemoryError"),
    # Whichever limit comes first contains it: 10 CPU seconds take longer than the 15 s wall
    # limit on a busy machine. That the CPU limit itself holds is the test below.
    "infinite loop": ("while True:\n    pass", ("CPU time limit", "(wall clock)")),
    "print 1 GB": ("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)", "output exceeded"),
}


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    prefix = f"tools-{uuid.uuid4().hex[:8]}"
    worker = start_tools_worker(tmp_path_factory.mktemp("tools"), REDIS_URL, prefix, env={"AMPD_SECRET": SECRET})
    runner = ToolRunner(redis.Redis.from_url(REDIS_URL), prefix, queue_wait_s=20)
    yield prefix, worker, runner
    runner.close()
    kill_group(worker)


def run(runner: ToolRunner, name: str, **arguments):
    return asyncio.run(runner.run(name, json.dumps(arguments)))


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_python_is_contained_and_the_worker_stays_healthy(tools, attack):
    if not isolation().namespaces and attack in ("open a socket", "write outside scratch"):
        pytest.fail("this machine cannot create namespaces: network and file isolation are not in force")
    _, worker, runner = tools
    target = Path("/var/tmp") / f"ampd-pwned-{uuid.uuid4().hex}.txt"  # on the host's root filesystem
    code, expected = HOSTILE[attack]
    started = time.monotonic()
    outcome = run(runner, "python", code=code.format(target=target))
    assert not outcome.ok and outcome.content.startswith("python tool error:"), outcome.content[:300]
    assert any(e in outcome.content for e in ([expected] if isinstance(expected, str) else expected)), outcome.content[
        :500
    ]
    assert time.monotonic() - started < 30
    assert not target.exists()
    assert worker.poll() is None
    assert run(runner, "python", code="print(6 * 7)").content.strip() == "42"  # the worker still serves


def test_a_busy_loop_stops_at_its_cpu_limit_before_its_wall_limit():
    outcome = run_python("while True:\n    pass", Limits(wall_s=60.0, cpu_s=1))
    assert not outcome.ok and "CPU time limit of 1 s exceeded" in outcome.content, outcome.content[:500]


def test_the_sandbox_sees_neither_the_workers_environment_nor_other_processes(tools):
    _, worker, runner = tools
    code = ("import os\nprint(sorted(os.environ))\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
            f"print(open('/proc/{worker.pid}/environ').read())")  # fmt: skip
    outcome = run(runner, "python", code=code)
    assert SECRET not in outcome.content
    assert "['HOME', 'LANG', 'PATH', 'TMPDIR']" in outcome.content
    if isolation().namespaces:  # its own PID namespace: the worker's pid is not there
        assert not outcome.ok and "No such file or directory" in outcome.content


def test_a_killed_tools_worker_becomes_a_tool_error_in_the_conversation(tmp_path):
    prefix = f"kill-{uuid.uuid4().hex[:8]}"
    engine = start_sim_worker(tmp_path, "--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", prefix)
    worker = start_tools_worker(tmp_path, REDIS_URL, prefix)
    gateway = start_gateway(tmp_path, REDIS_URL, prefix)
    script = {"rounds": [{"tool_calls": [call("python", code="import time\ntime.sleep(20)")]}, {"output_tokens": 6}]}
    body = {"model": MODEL, "server_tools": ["python"], "sim_script": script,
            "messages": [{"role": "user", "content": "sleep a while"}]}  # fmt: skip
    try:
        with httpx.Client(timeout=60) as client:
            started = time.monotonic()
            pending = client.build_request("POST", f"{gateway.url}/v1/chat/completions", json=body,
                                           headers={"X-Session-Id": "killed"})  # fmt: skip
            result: dict = {}
            thread = threading.Thread(target=lambda: result.setdefault("r", client.send(pending)))
            thread.start()
            time.sleep(2.0)  # the job is running in a work horse by now
            kill_group(worker)
            thread.join(timeout=40)
        response = result["r"]
        assert response.status_code == 200 and time.monotonic() - started < 20  # not the job's 20 s: noticed
        reply = response.json()
        assert reply["ampd_tool_rounds"][0]["calls"][0]["ok"] is False
        assert reply["choices"][0]["finish_reason"] == "stop"
        transcript = json.loads(redis.Redis.from_url(REDIS_URL).get(f"{prefix}:transcript:public:killed"))
        assert "the tools worker running this call died" in transcript[2]["content"]
    finally:
        gateway.stop()
        stop(engine)
        if worker.poll() is None:
            kill_group(worker)


# -- the gateway intercepting tool calls --------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tools):
    prefix, _, _ = tools
    tmp = tmp_path_factory.mktemp("tool-stack")
    registry = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "20")
    prefill = start_sim_worker(tmp, "--role", "prefill", *registry)
    decode = start_sim_worker(tmp, "--role", "decode", *registry)
    gateway = start_gateway(tmp, REDIS_URL, prefix)
    yield prefix, gateway, Engine(decode.url, MODEL)
    gateway.stop()
    stop(prefill)
    stop(decode)
    store = redis.Redis.from_url(REDIS_URL)
    keys = list(store.scan_iter(match=f"{prefix}:*"))
    if keys:
        store.delete(*keys)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_iterative_rag_runs_three_retrieve_rounds_as_incremental_prefills(stack):
    prefix, gateway, decode = stack
    session_id = f"rag-{uuid.uuid4().hex}"
    script = {"rounds": [{"tool_calls": [call("retrieve", query=q)]}
                         for q in ("prefill decode disaggregation", "incremental prefill", "NIXL KV transfer")]
              + [{"output_tokens": 30}]}  # fmt: skip
    before_incremental = metric(gateway.url, 'ampd_ttft_seconds_count{kind="incremental"}')
    hits_before = decode.metrics()["vllm:prefix_cache_hits_total"]
    question = [{"role": "user", "content": "Explain how AMPD schedules prefills."}]
    response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120, headers={"X-Session-Id": session_id},
                          json={"model": MODEL, "server_tools": ["retrieve"], "sim_script": script,
                                "messages": question})  # fmt: skip
    assert response.status_code == 200, response.text
    body = response.json()
    rounds = body["ampd_tool_rounds"]
    assert [r["calls"][0]["name"] for r in rounds] == ["retrieve"] * 3 and all(r["calls"][0]["ok"] for r in rounds)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "stop" and message["content"] and "tool_calls" not in message
    # Four engine rounds on the bound decode worker; the three after the first were incremental.
    record = redis.Redis.from_url(REDIS_URL, decode_responses=True).hgetall(f"{prefix}:session:public:{session_id}")
    assert record["rounds"] == "4" and record["decode_worker"].endswith(decode.url.rsplit(":", 1)[1])
    assert metric(gateway.url, 'ampd_ttft_seconds_count{kind="incremental"}') == before_incremental + 3
    assert decode.metrics()["vllm:prefix_cache_hits_total"] > hits_before  # the history stayed on the worker
    # The engine's transcript holds the tool rounds the client never saw; the next request continues it.
    transcript = json.loads(redis.Redis.from_url(REDIS_URL).get(f"{prefix}:transcript:public:{session_id}"))
    assert [m["role"] for m in transcript] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    assert "nixl.md" in transcript[6]["content"]
    follow = [*question, message, {"role": "user", "content": "Shorter, please."}]
    again = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, headers={"X-Session-Id": session_id},
                       json={"model": MODEL, "server_tools": ["retrieve"], "messages": follow})  # fmt: skip
    assert again.status_code == 200
    # Its prompt is the whole transcript (everything the decode worker held) plus the new message.
    assert again.json()["usage"]["prompt_tokens"] > int(record["l_hist"])


def test_streamed_tool_rounds_are_announced_and_hidden(stack):
    _, gateway, _ = stack
    script = {"rounds": [{"tool_calls": [call("calculator", expression="6*7")]}, {"output_tokens": 12}]}
    events = sse_events(httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "server_tools": ["calculator"],
        "sim_script": script, "messages": [{"role": "user", "content": "What is six times seven?"}]}))  # fmt: skip
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    announced = [c["ampd_tool_round"] for c in chunks if "ampd_tool_round" in c]
    call_id = announced[0]["calls"][0]["id"]
    ran = {"id": call_id, "name": "calculator", "arguments": '{"expression": "6*7"}', "ok": True, "output": "42"}
    assert call_id and announced == [{"round": 1, "calls": [ran]}]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["stop"]
    assert "".join(d["delta"].get("content") or "" for d in deltas).strip()
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 12


# One round of two parallel calls, one the tool answers and one it refuses: what each API's client sees of both.
ANSWERED, OUTPUT = "2**20 + 7", "1048583"
REFUSED, ERROR = "1/0", "calculator error: division by zero"
TWO_CALLS = {"server_tools": ["calculator"], "sim_script": {"rounds": [
    {"tool_calls": [call("calculator", expression=ANSWERED), call("calculator", expression=REFUSED)]},
    {"output_tokens": 6}]}}  # fmt: skip


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_chat_clients_read_each_server_tools_output_or_error(stack, streamed):
    client = openai.OpenAI(base_url=f"{stack[1].url}/v1", api_key="unused", max_retries=0)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "2**20 + 7, and 1/0?"}], "extra_body": TWO_CALLS}
    if streamed:
        chunks = list(client.chat.completions.create(**ask, stream=True))
        rounds = [c.model_extra["ampd_tool_round"] for c in chunks if "ampd_tool_round" in (c.model_extra or {})]
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(**ask)
        rounds, answer = reply.model_extra["ampd_tool_rounds"], reply.choices[0].message.content
    (tool_round,) = rounds
    assert tool_round["round"] == 1 and answer
    ran = [(c["name"], json.loads(c["arguments"]), c["ok"], c["output"]) for c in tool_round["calls"]]
    assert ran == [("calculator", {"expression": ANSWERED}, True, OUTPUT), ("calculator", {"expression": REFUSED},
                                                                               False, ERROR)]  # fmt: skip
    assert len({c["id"] for c in tool_round["calls"]}) == 2


def transcript_roles(prefix: str, session_id: str) -> list[str]:
    transcript = redis.Redis.from_url(REDIS_URL).get(f"{prefix}:transcript:public:{session_id}")
    return [m["role"] for m in json.loads(transcript)]


# The engine's transcript once a client sent the two calls' answer back and asked on: the gateway's calls kept.
CONTINUED = ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_responses_clients_read_server_tools_as_mcp_call_items(stack, streamed):
    client = openai.OpenAI(base_url=f"{stack[1].url}/v1", api_key="unused", max_retries=0)
    session = {"X-Session-Id": f"responses-{uuid.uuid4().hex}"}
    ask = {"model": MODEL, "input": "2**20 + 7, and 1/0?", "extra_body": TWO_CALLS, "extra_headers": session}
    if streamed:
        with client.responses.stream(**ask) as stream:
            kinds = [event.type for event in stream]
            response = stream.get_final_response()
        assert kinds.count("response.mcp_call.completed") == 1 and kinds.count("response.mcp_call.failed") == 1
        assert kinds.index("response.mcp_call.failed") < kinds.index("response.output_text.delta")
        stored = client.responses.retrieve(response.id)  # as it was streamed
        assert stored.output[:2] == response.output[:2] and stored.output_text == response.output_text
    else:
        response = client.responses.create(**ask)
    assert [item.type for item in response.output] == ["mcp_call", "mcp_call", "message"] and response.output_text
    answered, refused = response.output[:2]
    assert isinstance(answered, McpCall) and isinstance(refused, McpCall)
    assert (answered.name, json.loads(answered.arguments), answered.server_label) == (
        "calculator", {"expression": ANSWERED}, "ampd")  # fmt: skip
    assert (answered.status, answered.output, answered.error) == ("completed", OUTPUT, None)
    assert (refused.status, refused.output, refused.error) == ("failed", None, ERROR)
    assert "ampd_tool_rounds" not in (response.model_extra or {})  # the items say it: no extension field besides
    # The output sent back as input, as agents do: the gateway's own calls are skipped, the session goes on.
    echoed = [item.model_dump(exclude_none=True) for item in response.output]
    again = client.responses.create(model=MODEL, extra_headers=session, input=[
        {"role": "user", "content": ask["input"]}, *echoed, {"role": "user", "content": "Thanks"}])  # fmt: skip
    assert again.status == "completed" and again.output_text
    assert transcript_roles(stack[0], session["X-Session-Id"]) == CONTINUED


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_messages_clients_read_server_tools_as_mcp_tool_blocks(stack, streamed):
    client = anthropic.Anthropic(base_url=stack[1].url, api_key="unused", max_retries=0)
    question = {"role": "user", "content": "2**20 + 7, and 1/0?"}
    session = {"X-Session-Id": f"messages-{uuid.uuid4().hex}"}
    ask = {"model": MODEL, "max_tokens": 64, "messages": [question], "extra_body": TWO_CALLS, "extra_headers": session}
    if streamed:
        with client.beta.messages.stream(**ask) as stream:
            message = stream.get_final_message()
    else:
        message = client.beta.messages.create(**ask)
    assert [b.type for b in message.content] == ["mcp_tool_use", "mcp_tool_result"] * 2 + ["text"]
    uses, results = message.content[0:4:2], message.content[1:4:2]
    assert all(isinstance(b, BetaMCPToolUseBlock) for b in uses)
    assert all(isinstance(b, BetaMCPToolResultBlock) for b in results)
    assert [(u.name, u.server_name, u.input) for u in uses] == [
        ("calculator", "ampd", {"expression": ANSWERED}), ("calculator", "ampd", {"expression": REFUSED})]  # fmt: skip
    assert [r.tool_use_id for r in results] == [u.id for u in uses] and len({u.id for u in uses}) == 2
    assert [r.is_error for r in results] == [False, True]
    texts = [r.content for r in results]
    assert all(isinstance(t, list) and isinstance(t[0], BetaTextBlock) for t in texts)
    assert [t[0].text for t in texts] == [OUTPUT, ERROR]
    assert message.stop_reason == "end_turn" and message.content[-1].text
    # The turn sent back whole, as agents do: the gateway's own blocks are skipped, the session goes on.
    turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
    again = client.beta.messages.create(model=MODEL, max_tokens=256, extra_headers=session,
                                        messages=[question, turn, {"role": "user", "content": "Thanks"}])  # fmt: skip
    assert again.stop_reason == "end_turn" and again.content[0].text
    assert transcript_roles(stack[0], session["X-Session-Id"]) == CONTINUED


def test_client_side_calls_in_the_same_turn_go_back_to_the_client(stack):
    _, gateway, _ = stack
    session_id = f"mixed-{uuid.uuid4().hex}"
    script = {"rounds": [{"tool_calls": [call("calculator", expression="21*2"), call("get_weather", city="Oslo")]},
                         {"output_tokens": 10}]}  # fmt: skip
    request = {"model": MODEL, "server_tools": ["calculator"], "tools": [WEATHER], "sim_script": script,
               "messages": [{"role": "user", "content": "Weather in Oslo, and 21*2?"}]}  # fmt: skip
    headers = {"X-Session-Id": session_id}
    first = httpx.post(f"{gateway.url}/v1/chat/completions", json=request, headers=headers, timeout=60).json()
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert first["ampd_tool_rounds"][0]["calls"][0]["name"] == "calculator"
    weather_id = choice["message"]["tool_calls"][0]["id"]
    request["messages"] += [choice["message"], {"role": "tool", "tool_call_id": weather_id, "content": "-2 C, snow"}]
    second = httpx.post(f"{gateway.url}/v1/chat/completions", json=request, headers=headers, timeout=60)
    assert second.status_code == 200 and second.json()["choices"][0]["finish_reason"] == "stop"
    transcript = json.loads(redis.Redis.from_url(REDIS_URL).get(f"{stack[0]}:transcript:public:{session_id}"))
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "tool", "assistant"]
    assert transcript[2]["content"] == "42" and transcript[3]["content"] == "-2 C, snow"


def test_a_tool_error_reaches_the_model_and_the_answer_still_comes(stack):
    _, gateway, _ = stack
    script = {"rounds": [{"tool_calls": [call("python", code="raise SystemExit(3)")]}, {"output_tokens": 8}]}
    body = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "server_tools": ["python"], "sim_script": script,
        "messages": [{"role": "user", "content": "run it"}]}).json()  # fmt: skip
    assert body["ampd_tool_rounds"][0]["calls"][0]["ok"] is False
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"server_tools": ["rm_rf"]}, "server_tools"), ({"server_tools": ["python"], "tools": [
        {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]}, "tools")],
)  # fmt: skip
def test_bad_server_tool_requests_are_refused(stack, extra, param):
    _, gateway, _ = stack
    response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra})  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == param
