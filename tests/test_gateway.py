"""The gateway end to end: real Redis, GPU-free workers and gateways in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from ampd.local_redis import free_port
from ampd.processes import process_tree
from gateway.engines.model_tokenizer import ModelTokenizer
from perfmodel.profile import DEFAULT_PROFILE, load_profile
from surface.registry import tokenizer_key
from tests.engines import Engine, process_running, sse_events, start_gateway, start_sim_worker, stop

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no network at import
REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


def script(rounds: int, output_tokens: int = 24) -> dict:
    calls = [{"output_tokens": output_tokens, "tool_calls": [{"name": "search", "arguments": {"q": f"step {i}"}}]}
             for i in range(rounds - 1)]  # fmt: skip
    return {"rounds": [*calls, {"output_tokens": output_tokens}]}


class Stack:
    def __init__(self, tmp, prefix: str, gateway_options: tuple[str, ...] = (), worker_options: tuple[str, ...] = ()):
        self.tmp, self.prefix = tmp, prefix
        self.redis = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        common = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "20", *worker_options)
        self.prefill = start_sim_worker(tmp, "--role", "prefill", *common)
        self.decode = start_sim_worker(tmp, "--role", "decode", "--enable-prompt-tokens-details", *common)
        self.gateways = [start_gateway(tmp, REDIS_URL, prefix, *gateway_options)]

    def add_gateway(self, *options: str):
        self.gateways.append(start_gateway(self.tmp, REDIS_URL, self.prefix, *options))
        return self.gateways[-1]

    @property
    def url(self) -> str:
        return self.gateways[0].url

    def close(self) -> None:
        for child in self.gateways:
            child.stop()
        stop(self.prefill)
        stop(self.decode)
        keys = list(self.redis.scan_iter(match=f"{self.prefix}:*", count=1000))
        if keys:
            self.redis.delete(*keys)

    def session(self, session_id: str) -> dict:
        return self.redis.hgetall(f"{self.prefix}:session:public:{session_id}")

    def slo_rounds(self) -> dict[tuple[str, str], float]:
        """ampd_slo_rounds_total by (rule, outcome)."""
        out: dict[tuple[str, str], float] = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith("ampd_slo_rounds_total{"):
                labels = dict(part.split("=") for part in line[line.index("{") + 1 : line.index("}")].split(","))
                out[(labels["rule"].strip('"'), labels["outcome"].strip('"'))] = float(line.rsplit(" ", 1)[1])
        return out

    def routes(self, gateway_url: str | None = None) -> dict[str, float]:
        text = httpx.get(f"{gateway_url or self.url}/metrics").text
        out: dict[str, float] = {"local": 0.0, "remote": 0.0}
        for line in text.splitlines():
            if line.startswith("ampd_route_total"):
                kind = "local" if 'route="local"' in line else "remote"
                out[kind] += float(line.rsplit(" ", 1)[1])
        return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("gateway"), f"test-{uuid.uuid4().hex[:8]}")
    yield s
    s.close()


def agent_loop(client: openai.OpenAI, rounds: int, stream_every: int = 2, session_id: str | None = None):
    """A ReAct-style loop through the OpenAI SDK; yields (headers, usage, finish) after each round."""
    messages: list = [{"role": "system", "content": "You are an agent."},
                      {"role": "user", "content": f"Research {uuid.uuid4().hex} " * 30}]  # fmt: skip
    extra = {"sim_script": script(rounds)}
    headers = {"X-Session-Id": session_id} if session_id else {}
    for k in range(rounds):
        if k % stream_every == 1:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, tools=[SEARCH], stream=True, stream_options={"include_usage": True},
                extra_body=extra, extra_headers=headers,
            )  # fmt: skip
            content, calls, usage, finish = "", {}, None, None
            for chunk in raw.parse():
                if chunk.usage:
                    usage = chunk.usage
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    finish = choice.finish_reason or finish
                    for tc in choice.delta.tool_calls or []:
                        call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        call["id"] = tc.id or call["id"]
                        call["name"] += (tc.function.name or "") if tc.function else ""
                        call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function",
                                          "function": {"name": c["name"], "arguments": c["arguments"]}}
                                         for c in calls.values()]  # fmt: skip
        else:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, tools=[SEARCH], extra_body=extra, extra_headers=headers
            )
            response = raw.parse()
            usage, finish = response.usage, response.choices[0].finish_reason
            message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if message.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "found " * 40})
        yield raw.headers, usage, finish


def test_a_five_round_agent_session_is_bound_once(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    rounds = list(agent_loop(client, 5))
    session_ids = {h["x-session-id"] for h, _, _ in rounds}
    assert len(session_ids) == 1  # inferred from the conversation: no id was given
    assert [f for _, _, f in rounds] == ["tool_calls"] * 4 + ["stop"]
    record = stack.session(session_ids.pop())
    assert record["decode_worker"] == f"sim-decode-127.0.0.1:{stack.decode.url.rsplit(':', 1)[1]}"
    assert int(record["rounds"]) == 5
    last = rounds[-1][1]
    assert int(record["l_hist"]) == last.prompt_tokens + last.completion_tokens
    routes = {h["x-ampd-route"].split(":", 1)[0] for h, _, _ in rounds}
    assert routes <= {"local", "remote"}


def test_every_round_of_a_session_can_be_read_back_by_its_key_only(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    session_id = f"s-{uuid.uuid4().hex[:8]}"
    counted = stack.slo_rounds()
    rounds = list(agent_loop(client, 3, session_id=session_id))
    body = httpx.get(f"{stack.url}/v1/sessions/{session_id}").json()
    # Every round is judged by every ITL rule, in its record and in /metrics.
    now = stack.slo_rounds()
    for rule in ("mean", "p95", "max"):
        met = sum(r["slo_met"][rule] for r in body["rounds"])
        assert now[(rule, "met")] - counted[(rule, "met")] == met
        assert now[(rule, "missed")] - counted[(rule, "missed")] == 3 - met
    for r in body["rounds"]:  # the longest gap bounds the other two
        assert r["max_itl_s"] >= max(r["p95_itl_s"], r["mean_itl_s"])
        assert not r["slo_met"]["max"] or (r["slo_met"]["p95"] and r["slo_met"]["mean"])
    assert body["id"] == session_id and len(body["rounds"]) == 3
    assert [r["kind"] for r in body["rounds"]] == ["initial", "incremental", "incremental"]
    for (headers, usage, _), record in zip(rounds, body["rounds"], strict=True):
        route, worker = headers["x-ampd-route"].split(":", 1)
        assert record["route"] == route
        assert worker == (record["prefill_worker"] if route == "remote" else record["decode_worker"])
        assert record["completion_tokens"] == usage.completion_tokens
        assert record["l_hist"] + record["l_incr"] == usage.prompt_tokens
        assert record["ttft_s"] > 0 and record["queue_wait_s"] >= 0
    assert body["rounds"][1]["l_hist"] > 0  # the decode worker held the first round
    command = [sys.executable, "-m", "ampd.cli", "sessions", "show", session_id, "--gateway", stack.url]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0 and "incremental" in shown.stdout, shown.stdout + shown.stderr
    active = [line for line in httpx.get(f"{stack.url}/metrics").text.splitlines()
              if line.startswith("ampd_sessions_active ")]  # fmt: skip
    assert active and float(active[0].split()[-1]) >= 1
    # Another tenant (another key) cannot see it: not found, not forbidden - the id space is per key.
    keyed = stack.add_gateway("--api-key", "sk-other")
    other = httpx.get(f"{keyed.url}/v1/sessions/{session_id}", headers={"Authorization": "Bearer sk-other"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "session_not_found"
    assert httpx.get(f"{keyed.url}/v1/sessions/{session_id}").status_code == 401


def test_a_tenant_guessing_another_tenants_session_id_and_prompt_lands_on_neither(stack):
    keyed = stack.add_gateway("--api-key", "sk-a", "--api-key", "sk-b", "--policy", "coloc")
    prompt = [{"role": "user", "content": f"our secret plan {uuid.uuid4().hex} " * 40}]

    def ask(key: str, session_id: str, messages: list) -> httpx.Response:
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}
        response = httpx.post(f"{keyed.url}/v1/chat/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {key}", "X-Session-Id": session_id})  # fmt: skip
        assert response.status_code == 200, response.text
        return response

    def cached(response: httpx.Response) -> int:
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = ask("sk-a", "shared-id", prompt)
    # The control: tenant A's own second session with the same prompt hits A's cached prefix.
    assert cached(ask("sk-a", "a-again", prompt)) > 0
    # Tenant B with A's session id and A's prompt: its own new session, and not one cached block.
    guess = ask("sk-b", "shared-id", prompt)
    assert guess.headers["x-session-id"] == "shared-id" and cached(guess) == 0

    def rounds(key: str) -> list:
        response = httpx.get(f"{keyed.url}/v1/sessions/shared-id", headers={"Authorization": f"Bearer {key}"})
        return response.json()["rounds"]

    assert len(rounds("sk-a")) == 1 and len(rounds("sk-b")) == 1
    # A's session carries on from A's own history; B's turn is not in it.
    follow = [*prompt, first.json()["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    ask("sk-a", "shared-id", follow)
    a_rounds = rounds("sk-a")
    assert len(a_rounds) == 2 and a_rounds[1]["kind"] == "incremental" and a_rounds[1]["l_hist"] > 0
    assert len(rounds("sk-b")) == 1


def test_no_prompt_text_or_key_reaches_a_log_unless_the_operator_asks(stack):
    canary, key = f"canary-{uuid.uuid4().hex}", f"sk-{uuid.uuid4().hex}"
    quiet = stack.add_gateway("--api-key", key, "--log-level", "debug")
    loud = stack.add_gateway("--api-key", key, "--log-content")
    for gateway in (quiet, loud):
        for stream in (False, True):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"{canary} " * 20}], "max_tokens": 8,
                    "stream": stream, "tools": [SEARCH], "sim_script": script(1)}  # fmt: skip
            ok = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            assert ok.status_code == 200, ok.text
        bad = {"model": MODEL, "messages": [{"role": "tool", "content": canary}]}
        refused = httpx.post(f"{gateway.url}/v1/chat/completions", json=bad, headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 400
    time.sleep(0.5)  # log lines are flushed as they are written; give the children a moment to write them
    logs = {path.name: path.read_text(errors="replace") for path in stack.tmp.glob("*.log")}
    loud_log = logs.pop(f"gateway-{loud.url.rsplit(':', 1)[1]}.log")
    assert f"gateway-{quiet.url.rsplit(':', 1)[1]}.log" in logs and any(n.startswith("worker-") for n in logs)
    assert [n for n, text in logs.items() if canary in text] == []
    assert [n for n, text in logs.items() if key in text] == [] and key not in loud_log
    assert canary in loud_log  # the operator's switch works, so the absence above means something


def test_no_round_loses_its_kv(stack):
    """Every round finds the session's history on the bound decode worker: locally
    prefilled rounds hit its prefix cache; remote ones pull only what is new."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    decode = Engine(stack.decode.url, MODEL)
    session_id = f"kv-{uuid.uuid4().hex}"
    previous = None
    hits_before = decode.metrics()["vllm:prefix_cache_hits_total"]
    pulled_before = decode.metrics()["vllm:nixl_bytes_transferred_sum"]
    block_bytes = 16 * load_profile(DEFAULT_PROFILE).model.kv_bytes_per_token  # the stack's workers' profile
    for headers, usage, _ in agent_loop(client, 4, stream_every=10, session_id=session_id):
        after = decode.metrics()
        hit = after["vllm:prefix_cache_hits_total"] - hits_before
        pulled_blocks = (after["vllm:nixl_bytes_transferred_sum"] - pulled_before) / block_bytes
        hits_before, pulled_before = after["vllm:prefix_cache_hits_total"], after["vllm:nixl_bytes_transferred_sum"]
        if previous is not None:
            held = previous.prompt_tokens + previous.completion_tokens
            assert hit >= (held - 16) // 16 * 16, (headers["x-ampd-route"], hit, held)
            if headers["x-ampd-route"].startswith("remote"):
                assert 0 < pulled_blocks <= -(-(usage.prompt_tokens - hit) // 16)
        previous = usage
    assert stack.session(session_id)["rounds"] == "4"


def test_litellm_drives_a_tool_session(stack):
    import litellm

    session_id = f"litellm-{uuid.uuid4().hex}"
    messages: list = [{"role": "user", "content": "Find three facts about Redis."}]
    finishes = []
    for _ in range(3):
        response = litellm.completion(
            model=f"openai/{MODEL}", api_base=f"{stack.url}/v1", api_key="unused", messages=messages,
            tools=[SEARCH], extra_headers={"X-Session-Id": session_id}, extra_body={"sim_script": script(3)},
        )  # fmt: skip
        choice = response.choices[0]
        finishes.append(choice.finish_reason)
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "a fact"})
    assert finishes == ["tool_calls", "tool_calls", "stop"]
    assert stack.session(session_id)["rounds"] == "3"


def test_streaming_passes_usage_only_when_asked(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 8}
    plain = sse_events(httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30))
    assert plain[-1] == "[DONE]" and all(c["choices"] for c in plain[:-1])
    assert plain[0]["choices"][0]["delta"]["role"] == "assistant"
    with_usage = sse_events(httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                                       json={**body, "stream_options": {"include_usage": True}}))  # fmt: skip
    assert with_usage[-2]["choices"] == [] and with_usage[-2]["usage"]["completion_tokens"] >= 1
    # The per-chunk counts the gateway asks the engine for (to time tokens) stay with it.
    assert all("usage" not in c for c in plain[:-1]) and all("usage" not in c for c in with_usage[:-2])


def test_prompts_are_counted_in_the_gateway_as_the_engine_counts_them(stack):
    """The GPU-free engines publish their tokenizer and chat template as a vLLM supervisor
    publishes a model's; the gateway counts prompts with them (gateway.engines.tokens) and
    checks its first counts against the engine's ``/tokenize``: for every shape a chat prompt
    takes, the count is the engine's own, and no check differs."""
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "kv  cache"}'}}
    conversations = [
        ([{"role": "user", "content": "hello"}], None),
        ([{"role": "system", "content": "Be brief.\n\n  Really."}, {"role": "user", "content": "Why? " * 50}],
         [SEARCH]),
        ([{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]},
          {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "found: 3 results\t(ok)"},
          {"role": "assistant", "content": "Done_now <|end|> ok"}, {"role": "user", "content": "ünïcode 東京 1.5e3"}],
         [SEARCH]),
    ]  # fmt: skip
    published = stack.redis.get(tokenizer_key(stack.prefix, MODEL))
    assert published is not None, "the engines published no tokenizer files"
    counter = ModelTokenizer(json.loads(published))
    for messages, tools in conversations:
        asked = {"model": MODEL, "messages": messages, **({"tools": tools} if tools else {})}
        engine = httpx.post(f"{stack.decode.url}/tokenize", json=asked, timeout=30).json()["count"]
        assert counter.count(messages, tools) == engine
        reply = httpx.post(f"{stack.url}/v1/chat/completions", json={**asked, "max_tokens": 2}, timeout=30).json()
        assert reply.get("usage", {}).get("prompt_tokens") == engine, reply

    def checked() -> dict[str, float]:
        lines = httpx.get(f"{stack.url}/metrics").text.splitlines()
        series = {r: f'ampd_prompt_count_checks_total{{result="{r}"}}' for r in ("equal", "differs")}
        return {r: next(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))
                for r, name in series.items()}  # fmt: skip

    # The gateway loads the files off the first round's path, then counts and checks: wait for its checks.
    deadline = time.monotonic() + 60
    while checked()["equal"] == 0 and time.monotonic() < deadline:
        httpx.post(f"{stack.url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                   "messages": [{"role": "user", "content": f"count me {time.monotonic()}"}]}, timeout=30)  # fmt: skip
        time.sleep(0.2)
    assert checked()["equal"] > 0 and checked()["differs"] == 0


def test_a_retried_request_is_recorded_once(stack):
    """A client whose stream broke retries the same request (ampd bench chaos: a replica
    killed after it recorded the round, before the client saw [DONE]). To the gateway the
    retry is the same conversation again: its round replaces the first record. (The client
    here reads each stream to its end: one that hangs up after the last token races the
    gateway's own reading of the engine's stream, and may leave no first record at all.)"""
    session_id = f"retry-{uuid.uuid4().hex[:8]}"
    headers = {"X-Session-Id": session_id}
    url = f"{stack.url}/v1/chat/completions"
    messages = [{"role": "user", "content": f"Plan {uuid.uuid4().hex} " * 20}]
    first = httpx.post(url, json={"model": MODEL, "messages": messages, "sim_script": script(2), "tools": [SEARCH]},
                       headers=headers, timeout=30).json()  # fmt: skip
    message = first["choices"][0]["message"]
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "found " * 9}]
    body = {"model": MODEL, "messages": messages, "stream": True, "tools": [SEARCH], "sim_script": script(2)}

    def recorded(count: int) -> list[dict]:
        """The session's records once ``count`` are there, or as they are at the deadline."""
        deadline, rounds = time.monotonic() + 10, []
        while time.monotonic() < deadline:
            rounds = httpx.get(f"{stack.url}/v1/sessions/{session_id}", timeout=30).json()["rounds"]
            if len(rounds) >= count:
                break
            time.sleep(0.05)
        return rounds

    # The second round, then the same request twice more: the first attempt and two retries.
    for _ in range(3):
        events = sse_events(httpx.post(url, json=body, headers=headers, timeout=30))
        assert events[-1] == "[DONE]"
    rounds = recorded(2)
    assert len(rounds) == 2 and [r["kind"] for r in rounds][0] == "initial"
    assert rounds[0]["request"] != rounds[1]["request"] and rounds[1]["request"].endswith(":1")
    # A new request (the conversation went on) is a new round.
    messages += [{"role": "assistant", "content": "".join(e["choices"][0]["delta"].get("content") or ""
                                                          for e in events[:-1] if e["choices"])},
                 {"role": "user", "content": "and then?"}]  # fmt: skip
    httpx.post(url, json={**body, "messages": messages, "stream": False}, headers=headers, timeout=30)
    assert len(recorded(3)) == 3


def test_a_shared_system_prompt_does_not_merge_sessions(stack):
    system = {"role": "system", "content": "Shared instructions. " * 10}
    ids = set()
    for user in ("first question", "second question"):
        response = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [system, {"role": "user", "content": user}], "max_tokens": 4})  # fmt: skip
        ids.add(response.headers["x-session-id"])
        reply = response.json()["choices"][0]["message"]
        follow = [system, {"role": "user", "content": user}, reply, {"role": "user", "content": "go on"}]
        again = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": follow, "max_tokens": 4})  # fmt: skip
        assert again.headers["x-session-id"] == response.headers["x-session-id"]
    assert len(ids) == 2


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": None},  # found by the fuzz test: was a 500
                                       {"role": "user", "content": [{"text": None}]}]}, 400, "type"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**8}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, 400, "tools"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function", "function": {"name": "f", "parameters": "an object, not a string"}}]},
         400, "tools"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                       {"role": "tool", "tool_call_id": "c1", "content": "out of the blue"}]},
         400, "messages"),
        ({"model": MODEL, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c2", "content": "answers another call"}]}, 400, "messages"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(stack, body, status, param):
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_oversized_and_malformed_bodies(stack):
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 * 2**20)}]}
    assert httpx.post(f"{stack.url}/v1/chat/completions", json=huge, timeout=30).status_code == 413
    nan = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}' % MODEL.encode()
    for raw in (b"{nope", b'{"model": "\xff\xfe", "messages": []}', nan):  # not JSON; not UTF-8; not JSON's number
        bad = httpx.post(f"{stack.url}/v1/chat/completions", content=raw, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text


def test_api_keys_and_no_workers(tmp_path, stack):
    keyed = stack.add_gateway(
        "--api-key", "sk-test-1", "--api-key", "sha256:" + __import__("hashlib").sha256(b"sk-2").hexdigest()
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{keyed.url}/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(f"{keyed.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    for key in ("sk-test-1", "sk-2"):
        ok = httpx.post(f"{keyed.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    # A gateway whose registry namespace has no workers: not ready, and 503 for requests.
    empty = start_gateway_unready(tmp_path)
    try:
        assert httpx.get(f"{empty.url}/readyz").status_code == 503
        response = httpx.post(f"{empty.url}/v1/chat/completions", json=body)
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker"
    finally:
        empty.stop()


def start_gateway_unready(tmp_path):
    from ampd.processes import spawn_gateway, wait_healthy

    port = free_port()
    child = spawn_gateway("empty", port, ["--redis-url", REDIS_URL, "--redis-prefix", f"empty-{uuid.uuid4().hex[:6]}"],
                          log=tmp_path / "empty.log")  # fmt: skip
    assert wait_healthy([child], 30, path="/healthz") is None
    return child


def test_two_gateways_share_bindings_queues_and_statistics(stack):
    second = stack.add_gateway()
    session_id = f"alt-{uuid.uuid4().hex}"
    messages: list = [{"role": "user", "content": "Plan a trip " * 40}]
    routes = []
    for k in range(4):
        url = (stack.url, second.url)[k % 2]
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"X-Session-Id": session_id},
                              json={"model": MODEL, "messages": messages, "tools": [SEARCH],
                                    "sim_script": script(4)})  # fmt: skip
        assert response.status_code == 200 and response.headers["x-session-id"] == session_id
        routes.append(response.headers["x-ampd-route"])
        message = response.json()["choices"][0]["message"]
        messages += [message]
        if message.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "ok " * 20})
    record = stack.session(session_id)
    assert record["rounds"] == "4"  # both replicas updated one record
    assert {r.split(":", 1)[1] for r in routes if r.startswith("local")} <= {record["decode_worker"]}

    # One prefill slot per worker, shared: under load through both replicas the in-flight
    # set never holds more than one task per worker, and every request completes.
    prefix, worst, done = stack.prefix, {}, threading.Event()

    def sample() -> None:
        while not done.is_set():
            for key in stack.redis.scan_iter(match=f"{prefix}:inflight:*"):
                worst[key] = max(worst.get(key, 0), stack.redis.zcard(key))
            time.sleep(0.002)

    def one(i: int) -> int:
        url = (stack.url, second.url)[i % 2]
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"job {i} " * 200}], "max_tokens": 4}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code

    sampler = threading.Thread(target=sample)
    sampler.start()
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(32)))
    done.set()
    sampler.join()
    assert statuses == [200] * 32
    assert worst and max(worst.values()) == 1
    assert "ampd_reorder_postponements_total" in httpx.get(f"{second.url}/metrics").text
    # Both replicas' observations land in the same windowed statistics.
    itl_samples = sum(int(stack.redis.hget(k, "n") or 0) for k in stack.redis.scan_iter(match=f"{prefix}:stat:itl:*"))
    assert itl_samples >= 32


def test_a_gateway_of_two_processes_is_two_replicas_behind_one_port(stack):
    """`ampd gateway --processes 2`: both processes answer on the port, each a replica of
    its own; an agent session goes on whichever takes each request; one scrape counts
    every process's requests; stopping the gateway stops both."""
    gateway = start_gateway(stack.tmp, REDIS_URL, stack.prefix, "--processes", "2")
    processes = process_tree(gateway.process.pid)[1:]
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 60
        while len(seen) < 2:  # a fresh connection each time: the kernel hands them to either process
            assert time.monotonic() < deadline, f"only {seen} answered"
            seen.add(httpx.get(f"{gateway.url}/readyz", headers={"Connection": "close"}).json()["replica"])
        alive = {k.rsplit(":", 1)[1] for k in stack.redis.scan_iter(match=f"{stack.prefix}:replica:*")}
        assert seen <= alive  # each process beats as a replica of the deployment
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(headers={"Connection": "close"}))  # fmt: skip
        session_id = f"mp-{uuid.uuid4().hex[:8]}"
        rounds = list(agent_loop(client, 4, session_id=session_id))
        assert [f for _, _, f in rounds] == ["tool_calls"] * 3 + ["stop"]
        assert int(stack.session(session_id)["rounds"]) == 4  # one session, whichever process ran each round
        metrics = httpx.get(f"{gateway.url}/metrics").text
        assert 'ampd_requests_total{status="200"} 4.0' in metrics  # both processes' requests, in one scrape
        decode = f"sim-decode-127.0.0.1:{stack.decode.url.rsplit(':', 1)[1]}"
        assert f'ampd_worker_role{{role="decode",worker="{decode}"}} 1.0' in metrics
    finally:
        gateway.stop()
    assert len(processes) >= 2
    deadline = time.monotonic() + 30  # the workers, and multiprocessing's helper, end after their parent
    while left := [p for p in processes if process_running(p)]:
        assert time.monotonic() < deadline, f"still running after the gateway stopped: {left}"
        time.sleep(0.1)


def test_routes_shift_to_local_under_load(tmp_path):
    """Lightly loaded, prefill workers have TTFT slack and take the rounds; when their
    windowed TTFT passes alpha * TTFT_thres, incremental prefills stay local. The engines
    keep the modelled pace (``--speed 1``: tens of milliseconds a prefill) and the SLO is
    a quarter second, so a quiet round's TTFT stays far below it on a busy machine, and 24
    sessions queueing on one prefill engine pass it whatever the machine."""
    stack = Stack(tmp_path, f"load-{uuid.uuid4().hex[:8]}", gateway_options=("--ttft-slo", "0.25"),
                  worker_options=("--speed", "1"))  # fmt: skip
    try:

        def session(i: int) -> list[str]:
            messages: list = [{"role": "user", "content": f"task {i} " * 150}]
            out = []
            for _ in range(3):
                response = httpx.post(f"{stack.url}/v1/chat/completions", timeout=120,
                                      json={"model": MODEL, "messages": messages, "tools": [SEARCH],
                                            "sim_script": script(3, 8)})  # fmt: skip
                out.append(response.headers["x-ampd-route"].split(":", 1)[0])
                message = response.json()["choices"][0]["message"]
                messages += [message]
                if message.get("tool_calls"):
                    messages.append(
                        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "x " * 300}
                    )
            return out

        session(99)  # warm up: the first hand-off's handshake is not load, and would sit in the window
        time.sleep(11)
        quiet = [r for i in range(3) for r in session(i)]  # one session at a time
        time.sleep(11)  # let the quiet phase's statistics leave the window
        with ThreadPoolExecutor(24) as pool:
            busy = [r for rs in pool.map(session, range(100, 148)) for r in rs]
        quiet_remote = quiet.count("remote") / len(quiet)
        busy_remote = busy.count("remote") / len(busy)
        assert quiet_remote > 0.8, quiet
        assert busy_remote < quiet_remote - 0.3, (quiet_remote, busy_remote)
        print(json.dumps({"quiet_remote_share": quiet_remote, "busy_remote_share": busy_remote}))
    finally:
        stack.close()
