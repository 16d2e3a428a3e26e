"""Response-building helpers of the sim engine, checked without a server."""

from __future__ import annotations

import json

import pytest

from workers.sim import protocol as p
from workers.sim.responder import Length, Responder
from workers.sim.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"term": {"type": "string"}}, "required": ["term"]},
        },
    }
]


def tool_reply():
    messages = [{"role": "user", "content": "define entropy"}]
    return Responder(Tokenizer(32000)).chat(messages, TOOLS, "auto", True, None, 1, Length(100))


def test_fast_delta_chunk_equals_the_generic_chunk_with_and_without_counts():
    ids = p.ResponseIds("chatcmpl-abc", 'model "quoted"', "chat.completion.chunk")
    delta = {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": '{"a": "\\u00e9"}'}}]}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "token_ids": None}
    assert p.delta_chunk_sse(ids, delta) == p.sse(p.chunk(ids, choice))
    usage = p.Usage(1234, 56, cached_tokens=1000)  # continuous_usage_stats: the counts without details
    assert p.delta_chunk_sse(ids, delta, usage) == p.sse(p.chunk(ids, choice, usage=usage.body(details=False)))


def test_streamed_tool_call_deltas_rebuild_the_call():
    reply = tool_reply()
    deltas = p.chat_deltas(reply, parses_tools=True)
    assert len(deltas) == len(reply.token_ids)
    calls = [c for d in deltas if d for c in d.get("tool_calls", [])]
    assert calls[0] == {"id": reply.tool_calls[0].id, "type": "function", "index": 0, "function": {"name": "lookup"}}
    assert "".join(c["function"].get("arguments", "") for c in calls[1:]) == reply.tool_calls[0].arguments
    assert deltas[-1] is None  # the EOS step adds nothing under a tool parser


def test_non_stream_message_and_finish_reason_follow_vllm():
    reply = tool_reply()
    auto = p.chat_message(reply, reply.text, "auto", parses_tools=True)
    assert auto["content"] is None and json.loads(auto["tool_calls"][0]["function"]["arguments"]) == {
        "term": "define entropy"
    }
    named = {"type": "function", "function": {"name": "lookup"}}
    assert p.chat_message(reply, reply.text, named, parses_tools=True)["content"] == ""
    assert p.chat_finish_reason("stop", reply, "auto", True, stream=False) == "tool_calls"
    assert p.chat_finish_reason("stop", reply, named, True, stream=False) == "stop"
    assert p.chat_finish_reason("length", reply, "auto", True, stream=True) == "length"
    cut = reply.prefix(3)  # cut before the call completed: no call to report
    assert not cut.tool_calls and p.chat_finish_reason("length", cut, "auto", True, stream=False) == "length"
