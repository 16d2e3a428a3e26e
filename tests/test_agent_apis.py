"""The APIs agents speak, end to end: OpenAI's Responses API and Anthropic's Messages API
through the real SDKs, on real Redis, GPU-free workers, a tools worker and gateways in
subprocesses - plus the pure translation underneath them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
import uuid
from urllib.parse import quote, unquote

import anthropic
import httpx
import openai
import pytest
import redis
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from gateway.apis import messages as messages_api
from gateway.apis import responses as responses_api
from gateway.apis.schema import APIError
from gateway.state.sessions import explicit_session_id
from tests.engines import kill_group, session_rounds, start_gateway, start_sim_worker, start_tools_worker, stop

REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ALIAS = "llama-3.1-8b"  # a served model name without a slash: the Agents SDK reads "org/" as a provider
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER_SCHEMA}
MESSAGES_TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER_SCHEMA}
KEYS = ("sk-agents-1", "sk-agents-2")


class Stack:
    """Prefill and decode GPU-free workers, a tools worker, an open gateway and a keyed one."""

    def __init__(self, tmp) -> None:
        self.prefix = f"agents-{uuid.uuid4().hex[:8]}"
        self.redis = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        common = ("--redis-url", REDIS_URL, "--redis-prefix", self.prefix, "--speed", "20")
        self.children = []
        self.tools = None
        try:
            self.children.append(start_sim_worker(tmp, "--role", "prefill", *common))
            self.children.append(start_sim_worker(tmp, "--role", "decode", "--enable-prompt-tokens-details", *common))
            self.tools = start_tools_worker(tmp, REDIS_URL, self.prefix)
            self.gateway = start_gateway(tmp, REDIS_URL, self.prefix, "--served-model-name", ALIAS)
            keyed = [arg for key in KEYS for arg in ("--api-key", key)]
            self.keyed = start_gateway(tmp, REDIS_URL, self.prefix, *keyed)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return self.gateway.url

    def close(self) -> None:
        for child in (getattr(self, "gateway", None), getattr(self, "keyed", None)):
            if child is not None:
                child.stop()
        for engine in self.children:
            stop(engine)
        if self.tools is not None and self.tools.poll() is None:
            kill_group(self.tools)
        keys = list(self.redis.scan_iter(match=f"{self.prefix}:*", count=1000))
        if keys:
            self.redis.delete(*keys)

    def rounds(self, session_id: str, count: int, url: str | None = None, key: str | None = None) -> list[dict]:
        """The session's round records once ``count`` are there."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return session_rounds(url or self.url, session_id, count, headers)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("agent-apis"))
    yield s
    s.close()


# -- OpenAI's Responses API ----------------------------------------------------------------------


def test_responses_function_call_round_trip_is_one_session(stack):
    """Round 1 (not streamed) returns a function_call; round 2 (streamed) answers it with
    previous_response_id and only the new item; both rounds are one session."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions="You are a weather agent.", input=f"Weather in Paris? {uuid.uuid4().hex}",
        tools=[RESPONSES_TOOL], max_output_tokens=64,
    )  # fmt: skip
    first = raw.parse()
    session_id = raw.headers["x-session-id"]
    assert first.id.startswith("resp_") and first.object == "response" and first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments)["city"]
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens

    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions="You are a weather agent.", previous_response_id=first.id, tools=[RESPONSES_TOOL],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, sunny"}], stream=True,
    )  # fmt: skip
    assert raw.headers["x-session-id"] == session_id
    events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text and done.output_text == text and done.previous_response_id == first.id
    assert [item.type for item in done.output] == ["message"] and done.output[0].content[0].type == "output_text"

    rounds = stack.rounds(session_id, 2)
    assert [r["kind"] for r in rounds] == ["initial", "incremental"]  # round 2 continued round 1's KV
    for record, usage in zip(rounds, (first.usage, done.usage), strict=True):  # the engine's own counts
        assert usage.input_tokens == record["l_hist"] + record["l_incr"]
        assert usage.output_tokens == record["completion_tokens"]


def test_responses_streamed_function_call_and_stateless_continuation(stack):
    """A streamed function_call (arguments as deltas); then a client that keeps its own
    history (no previous_response_id) sends it all back and stays in the same session."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    question = {"role": "user", "content": [{"type": "input_text", "text": f"Weather in Oslo? {uuid.uuid4().hex}"}]}
    raw = client.responses.with_raw_response.create(model=MODEL, input=[question], tools=[RESPONSES_TOOL], stream=True)
    session_id = raw.headers["x-session-id"]
    events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds
    done_args = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done_args.arguments == deltas and json.loads(deltas)["city"]
    call = events[-1].response.output[0]
    assert call.type == "function_call" and call.arguments == deltas

    history = [question, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": deltas},
               {"type": "function_call_output", "call_id": call.call_id, "output": "-2 C, snow"}]  # fmt: skip
    raw = client.responses.with_raw_response.create(model=MODEL, input=history, tools=[RESPONSES_TOOL], store=False)
    assert raw.headers["x-session-id"] == session_id  # inferred from the conversation itself
    second = raw.parse()
    assert second.output_text and second.store is False
    assert [r["kind"] for r in stack.rounds(session_id, 2)] == ["initial", "incremental"]
    with client.responses.stream(model=MODEL, input=history, tools=[RESPONSES_TOOL]) as stream:  # the SDK's helper
        helped = stream.get_final_response()  # it checks every event against the state it builds
    assert helped.output_text and helped.status == "completed"
    with pytest.raises(openai.NotFoundError):  # store: false kept nothing to continue from
        client.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=second.id)


@pytest.mark.parametrize("streamed", [False, True])
def test_the_openai_agents_sdk_runs_a_tool_agent_unchanged(stack, streamed):
    """The OpenAI Agents SDK as it ships: its default model speaks the Responses API and
    sends the whole conversation each turn. An agent with a function tool runs two turns
    (the call, then the answer after the tool's output), and the gateway keeps them one
    session, read back in GET /v1/sessions/{id}."""
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    sessions: list[str] = []

    async def session_of(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/responses"):
            sessions.append(response.headers["x-session-id"])

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return f"21 C and sunny in {city}"

    async def run() -> str:
        async with httpx.AsyncClient(event_hooks={"response": [session_of]}, timeout=60) as http:
            client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", http_client=http)
            agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                          model=OpenAIResponsesModel(model=MODEL, openai_client=client))  # fmt: skip
            question = f"Weather in Oslo? {uuid.uuid4().hex}"
            if not streamed:
                return (await Runner.run(agent, question, max_turns=4)).final_output
            result = Runner.run_streamed(agent, question, max_turns=4)
            async for _ in result.stream_events():
                pass
            return result.final_output

    answer = asyncio.run(run())
    assert isinstance(answer, str) and answer.strip()
    assert len(calls) == 1 and len(sessions) == 2 and sessions[0] == sessions[1]
    rounds = stack.rounds(unquote(sessions[0]), 2)
    assert len(rounds) == 2 and rounds[1]["l_hist"] > 0  # the second turn continued the first's KV


def test_responses_errors_have_openais_shape(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_does_not_exist")
    assert missing.value.body["code"] == "previous_response_not_found"
    for body, param in [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": [{"type": "bogus"}]}, "input"),
        ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c1", "output": "out of the blue"}]},
         "input"),
    ]:  # fmt: skip
        response = httpx.post(f"{stack.url}/v1/responses", json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)
    assert httpx.post(f"{stack.url}/v1/responses", content=b"{nope", timeout=30).json()["error"]["type"] == (
        "invalid_request_error"
    )


def test_another_keys_response_id_is_not_found(stack):
    mine = openai.OpenAI(base_url=f"{stack.keyed.url}/v1", api_key=KEYS[0], max_retries=0)
    theirs = openai.OpenAI(base_url=f"{stack.keyed.url}/v1", api_key=KEYS[1], max_retries=0)
    first = mine.responses.create(model=MODEL, input=f"Remember {uuid.uuid4().hex}", max_output_tokens=8)
    with pytest.raises(openai.NotFoundError) as other:
        theirs.responses.create(model=MODEL, input="What did they say?", previous_response_id=first.id)
    assert other.value.status_code == 404 and other.value.body["code"] == "previous_response_not_found"
    again = mine.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id, max_output_tokens=8)
    assert again.previous_response_id == first.id and again.output_text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.keyed.url}/v1", api_key="sk-wrong", max_retries=0).responses.create(
            model=MODEL, input="x"
        )


AGENTS_RECIPE = """
import sys
from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI

set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1] + "/v1", api_key="unused"))
set_tracing_disabled(True)  # else the SDK sends its traces to OpenAI

@function_tool
def get_weather(city: str) -> str:
    \"\"\"The weather in a city now.\"\"\"
    print("get_weather", city, file=sys.stderr)
    return f"21 C and sunny in {city}"

agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model="llama-3.1-8b")
print(Runner.run_sync(agent, "Weather in Oslo?").final_output)
"""


def test_the_agents_sdk_recipe_runs_against_a_served_model_name(stack):
    """The README's recipe, as a user runs it: the Agents SDK's default client and model
    lookup, in its default Responses mode, with the gateway's --served-model-name alias
    (the engines' own name, with its "org/", is read by the SDK as a provider)."""
    assert [m.id for m in openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused").models.list().data] == [
        ALIAS, MODEL,
    ]  # fmt: skip
    run = subprocess.run([sys.executable, "-c", AGENTS_RECIPE, stack.url], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "get_weather " in run.stderr, (run.stdout, run.stderr)  # the tool ran


def test_stored_responses_are_retrieved_listed_and_deleted_under_their_key(stack):
    mine = openai.OpenAI(base_url=f"{stack.keyed.url}/v1", api_key=KEYS[0], max_retries=0)
    theirs = openai.OpenAI(base_url=f"{stack.keyed.url}/v1", api_key=KEYS[1], max_retries=0)
    question = f"Weather in Paris? {uuid.uuid4().hex}"
    items = [{"role": "user", "content": question},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Briefly."}]}]  # fmt: skip
    created = mine.responses.create(model=MODEL, input=items, max_output_tokens=8)
    got = mine.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    listed = mine.responses.input_items.list(created.id)  # newest first, as OpenAI lists them
    assert [item.content[0].text for item in listed.data] == ["Briefly.", question]
    assert all(item.id and item.type == "message" for item in listed.data) and not listed.has_more
    one = mine.responses.input_items.list(created.id, order="asc", limit=1)
    assert [item.content[0].text for item in one.data] == [question] and one.has_more
    paged = [item.content[0].text for item in mine.responses.input_items.list(created.id, order="asc", limit=1)]
    assert paged == [question, "Briefly."]  # the SDK pages on with `after`
    for other in (lambda: theirs.responses.retrieve(created.id), lambda: theirs.responses.delete(created.id),
                  lambda: theirs.responses.input_items.list(created.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            other()
    streamed = list(mine.responses.create(model=MODEL, input=question, max_output_tokens=8, stream=True))
    final = streamed[-1].response
    assert mine.responses.retrieve(final.id).model_dump() == final.model_dump()  # as its last event had it

    mine.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as gone:
        mine.responses.retrieve(created.id)
    assert gone.value.body == {"message": f"Response with id '{created.id}' not found.", "type": "not_found_error",
                               "param": "response_id", "code": "not_found"}  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        mine.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as continued:
        mine.responses.create(model=MODEL, input="Go on.", previous_response_id=created.id)
    assert continued.value.body["code"] == "previous_response_not_found"
    unstored = mine.responses.create(model=MODEL, input=question, max_output_tokens=8, store=False)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unstored.id)


def test_every_path_answers_errors_in_its_apis_shape(stack):
    """Unknown paths, wrong methods, bad queries and oversized bodies: OpenAI's error body
    under /v1/chat and /v1/responses (and the gateway's other paths), Anthropic's under
    /v1/messages - never FastAPI's {"detail": ...}."""
    for method, path, status, words in [
        ("GET", "/v1/nowhere", 404, "Invalid URL (GET /v1/nowhere)"),
        ("GET", "/v1/chat/completions", 405, "Method not allowed (GET /v1/chat/completions); this path takes POST"),
        ("PUT", "/v1/responses", 405, "Method not allowed (PUT /v1/responses); this path takes POST"),
        ("GET", "/v1/responses/resp_x/input_items?limit=0", 400, "limit: Input should be greater than or equal to 1"),
    ]:
        response = httpx.request(method, f"{stack.url}{path}", timeout=30)
        assert response.status_code == status, (path, response.text)
        error = response.json()["error"]
        assert set(response.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
        assert error["message"] == words and error["type"] in ("invalid_request_error", "not_found_error")
    for method, path, status, kind in [
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        ("POST", "/v1/messages/nowhere", 404, "not_found_error"),
    ]:
        response = httpx.request(method, f"{stack.url}{path}", timeout=30)
        assert response.status_code == status, (path, response.text)
        assert response.json() == {"type": "error", "error": {"type": kind, "message": response.json()["error"][
            "message"]}} and path in response.json()["error"]["message"]  # fmt: skip
    huge = "x" * (9 * 2**20)  # past the gateway's 8 MiB
    with pytest.raises(openai.APIStatusError) as large:
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0).responses.create(
            model=MODEL, input=huge
        )
    assert large.value.status_code == 413 and large.value.body["code"] == "request_too_large"
    with pytest.raises(anthropic.APIStatusError) as large_message:
        anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": huge}]
        )
    assert large_message.value.status_code == 413
    assert large_message.value.body["error"]["type"] == "request_too_large"


def test_translated_apis_name_their_own_fields_in_errors(stack):
    """An error about the chat body a request became names the caller's fields: an orphan
    function_call_output is an ``input`` item, an oversized ``max_output_tokens`` is not
    chat's ``max_tokens``, an unanswered tool_result is a block of a Messages turn."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    orphan = [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "c1", "output": "x"}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=orphan)
    assert bad.value.body == {"message": "input.1: a function_call_output must follow the function_call it answers",
                              "type": "invalid_request_error", "param": "input", "code": None}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as long:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=10**7)
    assert long.value.body["param"] == "max_output_tokens", long.value.body
    assert long.value.body["message"].startswith("max_output_tokens=10000000 cannot be greater than")
    assert "max_tokens" not in long.value.body["message"]
    claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as unanswered:
        claude.messages.create(model=MODEL, max_tokens=8, messages=turns)
    words = "messages.2.content.0: a tool_result block must answer a tool_use block of the assistant message before it"
    assert unanswered.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": words}}


# -- Anthropic's Messages API --------------------------------------------------------------------


def test_messages_tool_use_round_trip_is_one_session(stack):
    """Round 1 (create) ends in tool_use; round 2 (the SDK's stream helper) answers it with
    a tool_result; the conversation makes them one session."""
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    question = {"role": "user", "content": f"Weather in Rome? {uuid.uuid4().hex}"}
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=64, system="You are a weather agent.", messages=[question], tools=[MESSAGES_TOOL]
    )
    first = raw.parse()
    session_id = raw.headers["x-session-id"]
    assert first.id.startswith("msg_") and first.type == "message" and first.role == "assistant"
    assert first.stop_reason == "tool_use" and first.model == MODEL
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input["city"]
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0

    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": [{"type": "text", "text": "25 C"}]}
    messages = [question, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [result]}]  # fmt: skip
    with client.messages.stream(
        model=MODEL, max_tokens=64, system="You are a weather agent.", messages=messages, tools=[MESSAGES_TOOL]
    ) as stream:
        assert stream.response.headers["x-session-id"] == session_id
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.stop_reason == "end_turn" and final.content[0].type == "text" and final.content[0].text
    rounds = stack.rounds(session_id, 2)
    assert [r["kind"] for r in rounds] == ["initial", "incremental"]
    for record, usage in zip(rounds, (first.usage, final.usage), strict=True):  # the engine's own counts
        assert usage.input_tokens == record["l_hist"] + record["l_incr"]
        assert usage.output_tokens == record["completion_tokens"]


def test_messages_streams_tool_use_as_input_json_deltas(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    with client.messages.stream(
        model=MODEL, max_tokens=64, tools=[MESSAGES_TOOL], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": [{"type": "text", "text": f"Lima? {uuid.uuid4().hex}"}]}],
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == final.content[0].input and final.stop_reason == "tool_use"


def test_messages_stop_sequences_and_max_tokens(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    ask = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": f"A story {uuid.uuid4().hex}"}],
        "extra_body": {"seed": 7},
    }  # fmt: skip  (seeded: the GPU-free engine says the same again)
    whole = client.messages.create(**ask)
    words = whole.content[0].text.split()
    assert whole.stop_reason == "end_turn" and len(words) >= 4
    stopped = client.messages.create(**ask, stop_sequences=["NEVER", words[3]])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[3]
    assert whole.content[0].text.startswith(stopped.content[0].text) and words[3] not in stopped.content[0].text
    short = client.messages.create(**dict(ask, max_tokens=3))
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_count_tokens_counts_what_the_message_would_prompt(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    ask = {"model": MODEL, "system": "Be brief.", "tools": [MESSAGES_TOOL],
           "messages": [{"role": "user", "content": f"Weather in Kyiv? {uuid.uuid4().hex}"}]}  # fmt: skip
    counted = client.messages.count_tokens(**ask)
    assert counted.input_tokens == client.messages.create(**ask, max_tokens=8).usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def test_messages_errors_have_anthropics_shape(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    missing = {"type": "not_found_error", "message": "The model `no-such-model` does not exist."}
    assert unknown.value.body == {"type": "error", "error": missing}
    for body in [
        {"model": MODEL, "messages": [{"role": "user", "content": "no max_tokens"}]},
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
         "tool_choice": {"type": "sometimes"}},
        {"model": MODEL, "max_tokens": 8, "messages": [  # a result that answers no tool_use
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
    ]:  # fmt: skip
        response = httpx.post(f"{stack.url}/v1/messages", json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
        assert set(response.json()["error"]) == {"type", "message"}
    malformed = httpx.post(f"{stack.url}/v1/messages", content=b"{nope", timeout=30)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"


def test_messages_accept_x_api_key(stack):
    ask = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    keyed = anthropic.Anthropic(base_url=stack.keyed.url, api_key=KEYS[1], max_retries=0)  # sends x-api-key
    assert keyed.messages.create(**ask).stop_reason in ("end_turn", "max_tokens")
    bearer = httpx.post(f"{stack.keyed.url}/v1/messages", json=ask, headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert bearer.status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        anthropic.Anthropic(base_url=stack.keyed.url, api_key="sk-wrong", max_retries=0).messages.create(**ask)
    assert wrong.value.body["error"]["type"] == "authentication_error"


# -- server-side tools, session headers ----------------------------------------------------------


def test_server_tools_run_behind_both_apis(stack):
    """The gateway runs its own tool and the next round; the client sees the call as its API
    shows a call a server ran, then the answer - the plain SDKs too, which know no such type."""
    script = {"rounds": [{"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]},
                         {"output_tokens": 12}]}  # fmt: skip
    extra = {"server_tools": ["calculator"], "sim_script": script}
    openai_client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    response = openai_client.responses.create(model=MODEL, input="What is six times seven?", extra_body=extra)
    assert [item.type for item in response.output] == ["mcp_call", "message"] and response.output_text
    assert (response.output[0].name, response.output[0].output) == ("calculator", "42")
    events = list(openai_client.responses.create(model=MODEL, input="6*7 again?", extra_body=extra, stream=True))
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["mcp_call", "message"]
    assert not any(e.type.startswith("response.function_call") for e in events)

    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "6*7?"}],
                                extra_body=extra) as stream:  # fmt: skip
        session_id = stream.response.headers["x-session-id"]
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert [b.type for b in final.content] == ["mcp_tool_use", "mcp_tool_result", "text"]
    assert final.usage.output_tokens > 12  # both engine rounds counted
    transcript = json.loads(stack.redis.get(f"{stack.prefix}:transcript:public:{session_id}"))
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"] and transcript[2][
        "content"
    ] == "42"


def test_agent_session_headers_bind_rounds_to_one_session(stack):
    """Unrelated conversations that an agent client marks as one session are one session."""
    claude = f"cc-{uuid.uuid4().hex}"
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0,
                                 default_headers={"X-Claude-Code-Session-Id": claude})  # fmt: skip
    for topic in ("tides", "volcanoes"):
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": f"{topic} {uuid.uuid4().hex}"}]
        )
        assert raw.headers["x-session-id"] == claude
    assert len(stack.rounds(claude, 2)) == 2

    codex = f"codex-{uuid.uuid4().hex}"
    responses = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", default_headers={"session_id": codex})
    for topic in ("rivers", "glaciers"):
        raw = responses.responses.with_raw_response.create(model=MODEL, input=topic, max_output_tokens=4)
        assert raw.headers["x-session-id"] == codex
    assert len(stack.rounds(codex, 2)) == 2

    # ampd's own header comes first; Claude Code's metadata.user_id names a session when no header does.
    own = f"own-{uuid.uuid4().hex}"
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}], extra_headers={"X-Session-Id": own}
    )
    assert raw.headers["x-session-id"] == own
    plain = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    inner = uuid.uuid4().hex
    raw = plain.messages.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "y"}],
        metadata={"user_id": f"user_{'a' * 64}_account_{uuid.uuid4()}_session_{inner}"},
    )  # fmt: skip
    assert raw.headers["x-session-id"] == inner
    # Any id a body names reaches the client: one a header cannot carry comes percent-encoded.
    odd = f"Ā\n{uuid.uuid4().hex}"
    raw = responses.responses.with_raw_response.create(
        model=MODEL, input="x", max_output_tokens=4, stream=True, extra_headers={"session_id": ""},
        extra_body={"conversation": {"id": odd}},
    )  # fmt: skip
    last = list(raw.parse())[-1]
    assert raw.headers["x-session-id"] == quote(odd, safe="")
    if last.type == "response.incomplete":  # 4 tokens were not enough for the whole answer
        assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    else:
        assert last.type == "response.completed"
    assert len(stack.rounds(quote(odd, safe=""), 1)) == 1


def test_a_session_header_is_scoped_to_its_key(stack):
    shared = f"shared-{uuid.uuid4().hex}"
    for key in KEYS:
        client = anthropic.Anthropic(base_url=stack.keyed.url, api_key=key, max_retries=0,
                                     default_headers={"X-Claude-Code-Session-Id": shared})  # fmt: skip
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": key}])
    for key in KEYS:  # one round each: the same id names two sessions, one per key
        assert len(stack.rounds(shared, 1, url=stack.keyed.url, key=key)) == 1
    scopes = {hashlib.sha256(k.encode()).hexdigest()[:16] for k in KEYS}
    assert {s for s in scopes if stack.redis.exists(f"{stack.prefix}:session:{s}:{shared}")} == scopes


def test_a_client_hanging_up_a_translated_stream_stops_the_engine(tmp_path):
    """As on chat completions: a Responses or Messages client that leaves mid-stream ends
    the engine's request (its KV freed), and the gateway serves the next one."""
    prefix = f"agents-hangup-{uuid.uuid4().hex[:8]}"
    engine = start_sim_worker(
        tmp_path, "--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "0.25"
    )  # fmt: skip  (slow: the reply is still streaming when the client goes)
    gateway = start_gateway(tmp_path, REDIS_URL, prefix)
    long = {"seed": 3, "ignore_eos": True}
    asks = [
        ("/v1/responses", {"model": MODEL, "input": "Leave early", "max_output_tokens": 2000, "stream": True, **long}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 2000, "stream": True, **long,
                          "messages": [{"role": "user", "content": "Leave early too"}]}),
    ]  # fmt: skip
    try:
        for path, body in asks:
            with httpx.stream("POST", f"{gateway.url}{path}", json=body, timeout=60) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                deltas = 0
                while deltas < 5:
                    deltas += "delta" in next(lines)
                assert engine.metrics()["vllm:num_requests_running"] == 1
            deadline = time.monotonic() + 15
            while engine.metrics()["vllm:num_requests_running"] > 0:
                assert time.monotonic() < deadline, f"{path}: the engine request was not aborted"
                time.sleep(0.1)
            assert engine.metrics()["vllm:kv_cache_usage_perc"] == 0.0
        next_ask = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "next"}]}
        again = httpx.post(f"{gateway.url}/v1/messages", json=next_ask, timeout=60)
        assert again.status_code == 200 and again.json()["type"] == "message", again.text
    finally:
        gateway.stop()
        stop(engine)
        store = redis.Redis.from_url(REDIS_URL)
        keys = list(store.scan_iter(match=f"{prefix}:*"))
        if keys:
            store.delete(*keys)


# -- the translation itself (pure) ---------------------------------------------------------------


def _data(event: bytes) -> dict:
    """A server-sent event's JSON data."""
    return json.loads(event.decode().split("\ndata: ", 1)[1])


@pytest.mark.unit
def test_responses_items_become_chat_messages():
    raw = {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "sim_script": {"rounds": []},
        "tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
            {"type": "reasoning", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "19 C"}]},
        ],
    }  # fmt: skip
    chat, origins = responses_api.to_chat(raw, responses_api.parse_request(raw), [])
    assert origins.messages == ["instructions", "input.0", "input.1", "input.2", "input.6", "input.7"]
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "19 C"},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in RESPONSES_TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_tokens"] == 9 and chat["sim_script"] == {"rounds": []} and "input" not in chat
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    }


@pytest.mark.unit
def test_a_stored_response_continues_with_only_the_new_items():
    history = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}]  # fmt: skip
    raw = {"input": [{"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},  # echoed back
                     {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}  # fmt: skip
    chat, origins = responses_api.to_chat(raw, responses_api.parse_request(raw), history)
    assert chat["messages"] == [*history, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert origins.messages == ["previous_response_id", "previous_response_id", "input.1"]


@pytest.mark.unit
def test_chat_chunks_become_responses_events():
    request = responses_api.parse_request({"input": "x"})
    stream = responses_api.ResponseEvents("resp_1", request, "m", 1)
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]},
              {"choices": [{"delta": {"content": " there"}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "w"}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":1}'}}]}}]},
              {"choices": [], "ampd_tool_round": {"round": 1, "calls": [
                  {"id": "c2", "name": "calculator", "arguments": '{"expression":"1/0"}', "ok": False,
                   "output": "calculator error: division by zero"}]}}]  # fmt: skip
    raw = (
        stream.start()
        + [e for c in chunks for e in stream.feed(c)]
        + stream.finish({"prompt_tokens": 5, "completion_tokens": 4}, "tool_calls")
    )
    events = [_data(e) for e in raw]
    assert all(e.decode().startswith(f"event: {_data(e)['type']}\n") for e in raw)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.output_item.added", "response.mcp_call.in_progress",
        "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done", "response.mcp_call.failed",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-7]["item"]["status"] == "in_progress" and events[-7]["item"]["error"] is None
    done = events[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["message", "function_call", "mcp_call"]
    mcp = done["output"][2]
    assert mcp == events[-2]["item"] and mcp["id"].startswith("mcp_")
    assert {k: v for k, v in mcp.items() if k != "id"} == {
        "type": "mcp_call", "status": "failed", "server_label": "ampd", "name": "calculator",
        "arguments": '{"expression":"1/0"}', "output": None, "error": "calculator error: division by zero"}  # fmt: skip
    assert done["output"][0]["content"][0]["text"] == "Hi there" and done["output"][1]["arguments"] == '{"a":1}'
    assert done["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 4,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}  # fmt: skip


@pytest.mark.unit
def test_messages_blocks_become_chat_messages():
    raw = {
        "model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["END"],
        "tools": [MESSAGES_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "user_ab_account_cd_session_s-1"}, "server_tools": ["calculator"],
        "messages": [
            {"role": "user", "content": "Rome?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Rome"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "down",
                                          "is_error": True}, {"type": "text", "text": "Try again?"}]},
        ],
    }  # fmt: skip
    chat, origins = messages_api.to_chat(raw, messages_api.parse_request(raw))
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: down"},
        {"role": "user", "content": "Try again?"},
    ]  # fmt: skip
    assert chat["tools"][0]["function"] == {"name": "get_weather", "parameters": WEATHER_SCHEMA,
                                            "description": "Weather now"}  # fmt: skip
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["max_tokens"] == 7 and chat["server_tools"] == ["calculator"]
    assert chat["metadata"] == {"session_id": "s-1"}
    assert explicit_session_id({}, chat) == "s-1"
    assert origins.messages == ["system", "messages.0", "messages.1", "messages.2.content.0", "messages.2"]


@pytest.mark.unit
def test_chat_chunks_become_anthropic_events():
    stream = messages_api.MessageEvents("msg_1", "m", 11, ["END"])
    chunks = [{"choices": [{"delta": {"content": "Let me"}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "w"}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}]}]  # fmt: skip
    raw = (
        stream.start()
        + [e for c in chunks for e in stream.feed(c)]
        + stream.finish("tool_calls", None, {"prompt_tokens": 11, "completion_tokens": 6})
    )
    events = [_data(e) for e in raw]
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop",
    ]  # fmt: skip
    assert events[5]["content_block"] == {"type": "tool_use", "id": "t1", "name": "w", "input": {}}
    assert [e["index"] for e in events if e["type"].startswith("content_block")] == [0, 0, 0, 1, 1, 1, 1]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 11, "output_tokens": 6}


@pytest.mark.unit
def test_server_tool_rounds_become_mcp_blocks_which_a_turn_sent_back_skips():
    ran = {"id": "c1", "name": "calculator", "arguments": '{"expression":"6*7"}', "ok": True, "output": "42"}
    stream = messages_api.MessageEvents("msg_1", "m", 3, None)
    raw = (
        stream.start()
        + stream.feed({"choices": [{"delta": {"content": "Let me"}}]})
        + stream.feed({"choices": [], "ampd_tool_round": {"round": 1, "calls": [ran]}})
        + stream.finish("stop", None, None)
    )
    events = [_data(e) for e in raw]
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_stop", "content_block_start", "content_block_stop", "message_delta",
        "message_stop",
    ]  # fmt: skip
    assert [e["index"] for e in events if e["type"].startswith("content_block")] == [0, 0, 0, 1, 1, 2, 2]
    use, result = events[5]["content_block"], events[7]["content_block"]
    assert use == {"type": "mcp_tool_use", "id": use["id"], "name": "calculator", "server_name": "ampd",
                   "input": {"expression": "6*7"}}  # fmt: skip
    assert result == {"type": "mcp_tool_result", "tool_use_id": use["id"], "is_error": False,
                      "content": [{"type": "text", "text": "42"}]}  # fmt: skip
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
    turn = {"role": "assistant", "content": [{"type": "text", "text": "Let me"}, use, result,
                                             {"type": "text", "text": " see: 42"}]}  # fmt: skip
    asked = {"max_tokens": 5, "messages": [{"role": "user", "content": "6*7?"}, turn, {"role": "user", "content": "k"}]}
    chat, _ = messages_api.to_chat(asked, messages_api.parse_request(asked))
    assert chat["messages"][1] == {"role": "assistant", "content": "Let me see: 42"}


@pytest.mark.unit
def test_a_failure_after_the_status_line_is_reported_in_band():
    request = responses_api.parse_request({"input": "x"})
    failed = responses_api.ResponseEvents("resp_1", request, "m", 1).fail(APIError(502, "lost", code="upstream_error"))
    event = _data(failed[0])
    assert event["type"] == "response.failed" and event["response"]["status"] == "failed"
    assert event["response"]["error"] == {"code": "upstream_error", "message": "lost"}
    failed = messages_api.MessageEvents("msg_1", "m", 1, None).fail(APIError(503, "busy"))
    assert failed == [b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n']


@pytest.mark.unit
def test_stop_reasons_and_error_shapes():
    assert messages_api.stop_reason("stop", "END", ["END"], False) == ("stop_sequence", "END")
    assert messages_api.stop_reason("stop", None, ["END"], False) == ("end_turn", None)
    assert messages_api.stop_reason("length", None, None, False) == ("max_tokens", None)
    assert messages_api.stop_reason("stop", None, None, True) == ("tool_use", None)  # a named tool_choice
    assert messages_api.error_body(APIError(503, "busy")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "busy"}}  # fmt: skip
    assert messages_api.error_body(APIError(502, "x"))["error"]["type"] == "api_error"
    assert messages_api.session_hint('{"device_id": "d", "session_id": "s-2"}') == "s-2"
    assert messages_api.session_hint("plain-user") == "plain-user"


@pytest.mark.unit
def test_session_headers_in_their_documented_order():
    every = {"x-session-id": "a", "x-dynamo-session-id": "b", "x-claude-code-session-id": "c", "thread-id": "d",
             "session_id": "e", "session-id": "f", "conversation_id": "g"}  # fmt: skip
    order = ["x-session-id", "x-dynamo-session-id", "x-claude-code-session-id", "thread-id", "session_id",
             "session-id", "conversation_id"]  # fmt: skip
    for i, name in enumerate(order):
        assert explicit_session_id({k: v for k, v in every.items() if k not in order[:i]}, {}) == every[name]
    assert explicit_session_id({}, {"prompt_cache_key": "p", "user": "u", "metadata": {"session_id": "m"}}) == "p"
    assert explicit_session_id({}, {"user": "u", "metadata": {"session_id": "m"}}) == "u"
    assert explicit_session_id({}, {"metadata": {"session_id": "m"}}) == "m"
    assert explicit_session_id({"x-session-id": " "}, {}) is None
