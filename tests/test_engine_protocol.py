"""vLLM's HTTP surface, checked over HTTP against real engine processes.

Every test talks to the ``engine`` / ``pd_pair`` fixtures only through HTTP, so the
same module can run against a vLLM server: nothing here imports the sim engine.
Tests that rely on the sim's ``sim_script`` say so in their name.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from surface.wire import PREFILL_PARAMS
from tests.engines import Engine, sse_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def post(engine: Engine, path: str, body: dict, **kw) -> httpx.Response:
    # vLLM's CPU build under NIXL makes a token in about 0.25 s on two cores: be patient.
    return httpx.post(f"{engine.url}{path}", json={"model": engine.model, **body}, timeout=240, **kw)


def chat(engine: Engine, **body) -> httpx.Response:
    return post(engine, "/v1/chat/completions", body)


def test_models_and_health(engine: Engine):
    assert httpx.get(f"{engine.url}/health").status_code == 200
    cards = httpx.get(f"{engine.url}/v1/models").json()
    assert cards["object"] == "list"
    card = cards["data"][0]
    assert card["id"] == engine.model and card["object"] == "model" and card["max_model_len"] > 0


def test_chat_non_stream_shape(engine: Engine):
    body = chat(engine, messages=USER, max_tokens=20, seed=1).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 20
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None


def test_chat_stream_chunks(engine: Engine):
    response = chat(engine, messages=USER, max_tokens=12, seed=5, stream=True, stream_options={"include_usage": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *body, final, usage = chunks
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in body)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in body[1:] + [final])
    whole = chat(engine, messages=USER, max_tokens=12, seed=5).json()
    assert streamed == whole["choices"][0]["message"]["content"]
    assert usage["usage"] == {k: whole["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}


def test_tokenize_agrees_with_usage(engine: Engine):
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    usage = chat(engine, messages=messages, tools=[WEATHER], max_tokens=5).json()["usage"]
    counted = post(engine, "/tokenize", {"messages": messages, "tools": [WEATHER]}).json()
    assert counted["count"] == usage["prompt_tokens"] == len(counted["tokens"])
    plain = post(engine, "/tokenize", {"prompt": "Hello there, world"}).json()
    completion = post(engine, "/v1/completions", {"prompt": "Hello there, world", "max_tokens": 3}).json()
    assert plain["count"] == completion["usage"]["prompt_tokens"]
    assert plain["max_model_len"] > 0 and plain["token_strs"] is None


def test_tool_call_streams_as_deltas(engine: Engine):
    """A call forced with tool_choice "required" (a random-weight vLLM model would not
    choose one), streamed as vLLM streams it."""
    forced = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 96, "seed": 2}
    events = sse_events(chat(engine, messages=USER, stream=True, **forced))
    chunks = [e for e in events if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    head = calls[0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("chatcmpl-tool-")
    assert head["function"] == {"name": "get_weather"}
    assert all(set(tc) == {"index", "function"} for tc in calls[1:])
    arguments = "".join(tc["function"].get("arguments", "") for tc in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = chat(engine, messages=USER, **forced).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == json.loads(
        arguments
    )


def test_openai_sdk_runs_a_multi_round_tool_session(engine: Engine):
    """An agent loop written against the OpenAI SDK works unchanged."""
    client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused")
    messages: list = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    # A random-weight vLLM model can run out of tokens inside the forced call's JSON (seen
    # in CI: finish_reason "length"); another seed gives it another draw. The GPU-free
    # engine calls the tool on the first.
    for seed in range(3):
        first = client.chat.completions.create(model=engine.model, messages=messages, tools=[WEATHER],
                                               tool_choice="required", max_tokens=96, seed=seed)  # fmt: skip
        if first.choices[0].finish_reason == "tool_calls" or engine.kind != "vllm":
            break
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, cloudy"},
    ]
    stream = client.chat.completions.create(
        model=engine.model, messages=messages, tools=[WEATHER], stream=True, max_tokens=8,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    # The second round streams to its end. What a random-weight vLLM model says there is a
    # draw (seen under load: eight tokens of whitespace, or a tool call the parser holds as
    # such), so only the GPU-free engine's text is checked.
    assert finish and finish[-1] in ("stop", "length", "tool_calls") and chunks[-1].usage.completion_tokens > 0
    assert text.strip() or engine.kind == "vllm"


def test_sim_script_replays_rounds_exactly(engine: Engine):
    script = {
        "rounds": [
            {"output_tokens": 30, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
            {"output_tokens": 9},
        ]
    }
    first = chat(engine, messages=USER, tools=[WEATHER], sim_script=script).json()
    assert first["usage"]["completion_tokens"] == 30
    message = first["choices"][0]["message"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    follow = USER + [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "-3 C"}]
    second = chat(engine, messages=follow, tools=[WEATHER], sim_script=script).json()
    assert second["usage"]["completion_tokens"] == 9 and second["choices"][0]["finish_reason"] == "stop"


def test_completions_stream_and_non_stream(engine: Engine):
    whole = post(engine, "/v1/completions", {"prompt": "Once upon", "max_tokens": 8, "seed": 3}).json()
    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-")
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 8
    events = sse_events(
        post(engine, "/v1/completions", {"prompt": "Once upon", "max_tokens": 8, "seed": 3, "stream": True})
    )
    assert events[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


FIRSTS = "vllm:time_to_first_token_seconds_count"  # one more: a request's stats are in


def test_metrics_use_vllm_names(engine: Engine):
    before = engine.metrics()
    chat(engine, messages=USER, max_tokens=4)
    after = engine.metrics_once(lambda m: m[FIRSTS] > before[FIRSTS])
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:nixl_xfer_time_seconds_count",
    ):
        assert name in after, name
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after['vllm:request_success_total{"finished_reason": "length"}'] >= 1
    assert 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0


def test_a_cache_salt_keeps_prefix_blocks_apart(engine: Engine):
    prompt = [{"role": "user", "content": f"salted {uuid.uuid4().hex} " + "words " * 300}]

    def hits_after(salt: str) -> float:
        before = engine.metrics()
        assert chat(engine, messages=prompt, max_tokens=1, cache_salt=salt).status_code == 200
        return engine.metrics_once(lambda m: m[FIRSTS] > before[FIRSTS])["vllm:prefix_cache_hits_total"]

    first = hits_after("tenant-a")
    other = hits_after("tenant-b")  # the same prompt under another salt: a miss
    same = hits_after("tenant-a")
    assert other == first and same > other


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"model": "no-such-model", "messages": USER}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, None),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ],
)
def test_errors_have_openai_shape(engine: Engine, path, body, status, param):
    response = httpx.post(f"{engine.url}{path}", json={"model": engine.model, **body}, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]


def test_prompt_length_is_checked_in_chars_then_tokens(engine: Engine):
    """vLLM refuses a prompt longer in characters than the context could hold before
    tokenizing it (``input_text``), and then one longer in tokens (``input_tokens``)."""
    limit = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["max_model_len"]
    for words, param in ((limit * 64 // 5 + 1, "input_text"), (limit + 8, "input_tokens")):
        response = chat(engine, messages=[{"role": "user", "content": "word " * words}], max_tokens=1)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_any_role_the_template_renders_is_accepted(engine: Engine):
    """vLLM takes custom roles (its chat template decides); OpenAI's API would refuse them."""
    response = chat(engine, messages=[{"role": "robot", "content": "beep"}], max_tokens=3)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_a_final_assistant_message_is_continued(engine: Engine):
    """``continue_final_message`` (what request migration sends: gateway.engines.migration): the
    prompt is the round's prompt followed by the text so far, and generation goes on from
    it. Both it and ``add_generation_prompt`` at once is the chat template's error, a 400."""
    partial = "The weather in Paris is"
    continued = [*USER, {"role": "assistant", "content": partial}]
    ending = {"add_generation_prompt": False, "continue_final_message": True}
    open_prompt = post(engine, "/tokenize", {"messages": USER}).json()["count"]
    prompt = post(engine, "/tokenize", {"messages": continued, **ending}).json()["count"]
    reply = chat(engine, messages=continued, max_tokens=4, **ending)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == prompt > open_prompt
    if engine.kind == "sim":  # its template opens the assistant turn the same way in both
        text = post(engine, "/tokenize", {"prompt": partial, "add_special_tokens": False}).json()["count"]
        assert prompt == open_prompt + text
    both = chat(engine, messages=continued, continue_final_message=True, max_tokens=4)
    assert both.status_code == 400
    assert both.json()["error"]["message"].startswith("continue_final_message and add_generation_prompt are not")
    explicit = {"continue_final_message": True, "add_generation_prompt": True}  # set by the client, both
    both = post(engine, "/tokenize", {"messages": continued, **explicit})
    assert both.status_code == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in both.json()["error"]["message"]


def test_content_parts_are_read_as_vllm_reads_them(engine: Engine):
    """vLLM 0.32 skips a typed part it cannot read (a null text, with a warning), answering
    from the rest, and refuses a part without its type."""
    first = {"type": "text", "text": "Paris? "}
    counts = []
    for parts in ([first], [first, {"type": "text", "text": None}]):
        response = chat(engine, messages=[{"role": "user", "content": parts}], max_tokens=4)
        assert response.status_code == 200, response.text
        counts.append(response.json()["usage"]["prompt_tokens"])
    assert counts[0] == counts[1]
    untyped = chat(engine, messages=[{"role": "user", "content": [first, {"text": None}]}], max_tokens=4)
    assert untyped.status_code == 400, untyped.text
    error = untyped.json()["error"]
    assert error["param"] == "type" and error["message"].startswith("Missing 'type' field in multimodal part.")


def test_malformed_json_is_a_400(engine: Engine):
    response = httpx.post(
        f"{engine.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == 400


def test_client_disconnect_aborts_and_frees_kv(engine: Engine):
    before = engine.metrics()
    with httpx.stream(
        "POST",
        f"{engine.url}/v1/chat/completions",
        timeout=30,
        json={"model": engine.model, "messages": USER, "max_tokens": 2000, "ignore_eos": True, "stream": True},
    ) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 30
    while (after := engine.metrics())["vllm:num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.2)
    time.sleep(0.5)
    settled = engine.metrics()
    generated = settled["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 1 <= generated < 2000 and settled["vllm:generation_tokens_total"] == after["vllm:generation_tokens_total"]
    assert after["vllm:kv_cache_usage_perc"] == pytest.approx(before["vllm:kv_cache_usage_perc"])
    # vLLM 0.32 does not count a request its client dropped as finished (no "abort" sample).
    abort = 'vllm:request_success_total{"finished_reason": "abort"}'
    assert after[abort] == before[abort]


# -- prefill/decode hand-off ---------------------------------------------------------

NIXL_PARAMS = PREFILL_PARAMS  # what vLLM's disaggregation proxy sends to the prefill engine


def handoff(prefill: Engine, decode: Engine, messages: list, max_tokens: int, **extra) -> tuple[dict, dict]:
    """vLLM's disaggregation proxy: prefill with max_tokens 1, then decode with its params."""
    first = chat(prefill, messages=messages, max_tokens=1, kv_transfer_params=NIXL_PARAMS, **extra)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    second = chat(decode, messages=messages, kv_transfer_params=params, max_tokens=max_tokens, **extra)
    assert second.status_code == 200, second.text
    return params, second.json()


def test_prefill_returns_nixl_transfer_params(pd_pair):
    prefill, _ = pd_pair
    body = chat(prefill, messages=USER, max_tokens=1, kv_transfer_params=NIXL_PARAMS).json()
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids"):
        assert params[key] not in (None, "", []), key
    assert params["remote_num_tokens"] == body["usage"]["prompt_tokens"]
    blocks = params["remote_block_ids"][0]
    assert len(blocks) == -(-body["usage"]["prompt_tokens"] // prefill.block_size)


def test_a_prefill_allowed_more_tokens_holds_the_kv_of_its_output_too(pd_pair):
    """A hand-off mid-decode (DynaServe's alpha; tests/test_vllm_handoffs.py): a prefill
    request allowed d tokens answers with d tokens and holds the KV of the prompt and its
    first d - 1 (the last has none yet), in as many blocks as those tokens fill."""
    prefill, _ = pd_pair
    d = 5
    body = chat(prefill, messages=USER, max_tokens=d, ignore_eos=True, kv_transfer_params=NIXL_PARAMS).json()
    params, usage = body["kv_transfer_params"], body["usage"]
    assert usage["completion_tokens"] == d
    assert params["remote_num_tokens"] == usage["prompt_tokens"] + d - 1
    assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // prefill.block_size)


def test_handoff_round_two_pulls_only_missing_blocks(pd_pair):
    prefill, decode = pd_pair
    block = decode.block_size
    messages = [
        # Unique, so that no earlier request left any of it in the decoder's prefix cache.
        {"role": "system", "content": f"Agent {uuid.uuid4().hex}. " + "You are a careful agent. " * 20},
        {"role": "user", "content": "Plan a trip to Paris."},
    ]

    def pulled_and_hit(before: dict, after: dict) -> tuple[float, float]:
        """Bytes NIXL moved (whole blocks) and prefix-cache hits."""
        pulled = after["vllm:nixl_bytes_transferred_sum"] - before["vllm:nixl_bytes_transferred_sum"]
        return pulled, after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]

    transfers = "vllm:nixl_xfer_time_seconds_count"
    before = decode.metrics()
    named = {"type": "function", "function": {"name": "get_weather"}}
    params1, reply1 = handoff(prefill, decode, messages, 96, tools=[WEATHER], tool_choice=named, seed=1)
    mid = decode.metrics_once(lambda m: m[transfers] > before[transfers])
    pulled1, hit1 = pulled_and_hit(before, mid)
    assert mid[transfers] == before[transfers] + 1
    missing1 = len(params1["remote_block_ids"][0]) - hit1 // block  # blocks the decoder lacked
    assert missing1 > 0 and pulled1 % missing1 == 0
    block_bytes = pulled1 // missing1
    message = {k: v for k, v in reply1["choices"][0]["message"].items() if v is not None}
    if message.get("tool_calls"):
        result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "Sunny, 24 C. " * 10}
    else:  # a random-weight vLLM model may run out of tokens inside the forced call's JSON
        assert decode.kind == "vllm", "round 1 should call the tool"
        result = {"role": "user", "content": "Sunny, 24 C. " * 10}
    messages = messages + [message, result]
    params2, reply2 = handoff(prefill, decode, messages, 8, tools=[WEATHER], tool_choice="none")
    pulled2, hit2 = pulled_and_hit(mid, decode.metrics_once(lambda m: m[transfers] > mid[transfers]))
    # Round 1's prompt (and output) are cached on the decoder: it pulls only the rest.
    assert hit2 >= (params1["remote_num_tokens"] // block) * block > hit1
    assert pulled2 == (len(params2["remote_block_ids"][0]) - hit2 // block) * block_bytes > 0
    assert reply2["choices"][0]["finish_reason"] in ("stop", "length")
    assert reply2["usage"]["prompt_tokens"] == params2["remote_num_tokens"]


def test_stale_transfer_params_leave_the_decoder_healthy(pd_pair):
    """Transfer params whose blocks were already pulled (and released). vLLM reads the
    remote blocks over NIXL without checking what they now hold: 200, with whatever KV
    the memory has. The GPU-free engine checks block contents against the prompt and
    fails the load (500, its default policy). Either way the engine keeps serving."""
    prefill, decode = pd_pair
    params = chat(prefill, messages=USER, max_tokens=1, kv_transfer_params=NIXL_PARAMS).json()["kv_transfer_params"]
    chat(decode, messages=USER, kv_transfer_params=params, max_tokens=4)  # consumes the held blocks
    other = [{"role": "user", "content": "other prompt entirely"}]
    again = chat(decode, messages=other, kv_transfer_params=params, max_tokens=4)
    if decode.kind == "vllm":
        assert again.status_code == 200
    else:
        assert again.status_code == 500 and again.json()["error"]["type"] == "InternalServerError"
    assert chat(decode, messages=USER, max_tokens=3).status_code == 200  # the engine is fine
