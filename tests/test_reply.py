"""gateway.engines.upstream.Reply: a streamed completion's timing, per token."""

from __future__ import annotations

import pytest

from gateway.engines.upstream import Reply

pytestmark = pytest.mark.unit


def chunk(content: str, completion_tokens: int | None = None, finish: str | None = None) -> dict:
    out: dict = {"id": "c", "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}
    if completion_tokens is not None:
        out["usage"] = {"prompt_tokens": 5, "completion_tokens": completion_tokens}
    return out


def test_a_chunk_that_brings_several_tokens_spreads_its_gap_over_them():
    """As vLLM's tool parser streams: nothing for some tokens, then one chunk with them all."""
    reply = Reply(started=0.0)
    for at, text, counted in ((1.0, "a", 1), (1.5, "b", 2), (4.5, "cde", 5)):
        assert reply.observe(chunk(text, counted), at)
    assert reply.observe(chunk("", 5, finish="stop"), 4.6)  # relayed (it ends the message), but no token: no gap
    assert not reply.observe({"id": "c", "choices": [], "usage": {"completion_tokens": 5}}, 4.7)
    assert reply.ttft_s == 1.0 and reply.itl == [0.5, 1.0, 1.0, 1.0]
    assert reply.content == "abcde" and reply.finish_reason == "stop" and reply.usage == {"completion_tokens": 5}


def test_without_per_chunk_counts_a_chunk_is_a_token():
    reply = Reply(started=0.0)
    for at, text in ((1.0, "a"), (1.5, "b"), (4.5, "cde")):
        reply.observe(chunk(text), at)
    assert reply.itl == [0.5, 3.0]
