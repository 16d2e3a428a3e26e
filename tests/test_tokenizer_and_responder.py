"""The sim engine's tokenizer, chat template and reply planning."""

from __future__ import annotations

import json
import random

import pytest

from workers.sim.responder import Length, Responder, ScriptError, SimScript
from workers.sim.tokenizer import EOS_ID, Tokenizer, files, render_chat

pytestmark = pytest.mark.unit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "retrieve",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                "required": ["query", "k"],
            },
        },
    }
]
tok = Tokenizer(128256)
responder = Responder(tok)
LONG = Length(max_tokens=1000)


def reply_for(messages, script=None, seed=None, tool_choice="auto", length=LONG):
    text = render_chat(messages, TOOLS)
    return text, responder.chat(messages, TOOLS, tool_choice, True, script, seed, length)


def as_message(reply) -> dict:
    msg = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    return msg


def test_pieces_partition_the_text_and_ids_are_stable():
    text = "Hello,  world!\n\n  foo_bar 42 <|start|>x<tool_call>{}</tool_call>"
    assert "".join(tok.pieces(text)) == text
    assert tok.encode(text) == Tokenizer(128256).encode(text)
    assert all(0 < t < 128256 for t in tok.encode(text))


def test_next_round_prompt_extends_previous_prompt_and_output():
    """The property prefix caching and incremental prefill rest on."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Find   x\tplease"}]
    for _ in range(3):
        text, reply = reply_for(messages)
        prompt = tok.encode(text)
        messages = messages + [as_message(reply)]
        if reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": " result:  \n x=1"})
        else:
            messages.append({"role": "user", "content": "and y?"})
        following = tok.encode(render_chat(messages, TOOLS))
        assert following[: len(prompt) + len(reply.token_ids)] == prompt + reply.token_ids


def test_default_policy_calls_a_tool_then_answers():
    messages = [{"role": "user", "content": "What is AMPD?"}]
    _, first = reply_for(messages)
    assert [c.name for c in first.tool_calls] == ["retrieve"]
    assert json.loads(first.tool_calls[0].arguments) == {"query": "What is AMPD?", "k": 1}
    messages += [as_message(first), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "doc"}]
    _, second = reply_for(messages)
    assert not second.tool_calls and second.token_ids[-1] == EOS_ID
    assert len(second.token_ids) == responder.default_output_tokens


def test_output_is_deterministic_given_a_seed():
    messages = [{"role": "user", "content": "hi"}]
    a = reply_for(messages, seed=3, tool_choice="none")[1]
    b = reply_for(messages, seed=3, tool_choice="none")[1]
    c = reply_for(messages, seed=4, tool_choice="none")[1]
    assert a == b and a.text != c.text
    # Unseeded, two identical requests get different replies (and tool-call ids).
    assert reply_for(messages)[1].tool_calls[0].id != reply_for(messages)[1].tool_calls[0].id


def test_script_fixes_rounds_lengths_and_calls():
    script = SimScript.model_validate(
        {
            "rounds": [
                {"output_tokens": 40, "tool_calls": [{"name": "retrieve", "arguments": {"query": "a", "k": 2}}]},
                {"output_tokens": 7},
            ]
        }
    )
    messages = [{"role": "user", "content": "q"}]
    _, first = reply_for(messages, script=script)
    assert len(first.token_ids) == 40 and first.content and first.tool_calls[0].arguments == '{"query": "a", "k": 2}'
    messages += [as_message(first), {"role": "tool", "content": "r"}]
    _, second = reply_for(messages, script=script)
    assert len(second.token_ids) == 7 and not second.tool_calls


def test_script_naming_an_unoffered_tool_is_an_error():
    script = SimScript.model_validate({"rounds": [{"tool_calls": [{"name": "nope"}]}]})
    with pytest.raises(ScriptError):
        reply_for([{"role": "user", "content": "q"}], script=script)


def test_stop_string_ends_the_reply_before_it():
    messages = [{"role": "user", "content": "hi"}]
    full = reply_for(messages, seed=1, tool_choice="none")[1]
    stop = full.pieces[5].strip()
    cut = reply_for(messages, seed=1, tool_choice="none", length=Length(1000, stop=(stop,)))[1]
    assert cut.stop_reason == stop and stop not in cut.text
    assert full.text.startswith(cut.text) and len(cut.token_ids) <= 6


def test_ignore_eos_generates_exactly_max_tokens():
    messages = [{"role": "user", "content": "hi"}]
    reply = reply_for(messages, tool_choice="none", length=Length(max_tokens=50, ignore_eos=True))[1]
    assert len(reply.token_ids) == 50 and EOS_ID not in reply.token_ids


def test_the_published_files_split_text_where_the_engine_does():
    """The tokenizer.json the engine publishes (workers.sim.tokenizer.files), run by the
    ``tokenizers`` library, counts exactly the engine's pieces of any text: ASCII, every
    Unicode category (marks, numbers, symbols, separators, emoji), special tokens."""
    import unicodedata

    from tokenizers import Tokenizer as Files

    counter = Files.from_str(files(1 << 16)["tokenizer"])
    rng = random.Random(2)
    pool = [chr(c) for c in range(0x2FFFF) if unicodedata.category(chr(c)) != "Cs"]
    common = [*"ab Z09_-!?.,;:\n\t\r  ", "<|end|>", "<tool_call>", "</tool_call>", "<|start|>", "  \n", "a_b"]
    for _ in range(5000):
        text = "".join(
            rng.choice(pool) if rng.random() < 0.4 else rng.choice(common) for _ in range(rng.randint(0, 30))
        )
        assert len(counter.encode(text, add_special_tokens=False).ids) == len(tok.pieces(text)), repr(text)


def test_a_gateway_counts_a_prompt_with_the_published_files_as_the_engine_counts_it():
    """A gateway counts with the published tokenizer and chat template as it counts a vLLM
    model's (gateway.engines.model_tokenizer: message by message, vLLM's preprocessing, the
    Jinja template): equal to the engine's ``/tokenize`` path over the whole prompt (its
    request model, template and tokenizer) for random conversations - special tokens, odd
    whitespace, content parts, tool calls - wherever both count."""
    from pydantic import ValidationError

    from gateway.engines.model_tokenizer import ModelTokenizer
    from workers.sim.protocol import EngineError, TokenizeChatRequest, message_dicts

    vocab = Tokenizer(1 << 16)

    def engine(messages: list, tools: list | None) -> list[int] | None:
        try:
            chat = TokenizeChatRequest.model_validate({"model": "m", "messages": messages, "tools": tools or None})
            text = render_chat(message_dicts(chat.messages), [t.model_dump(exclude_none=True) for t in chat.tools]
                               if chat.tools else None)  # fmt: skip
        except (ValidationError, ValueError, EngineError):
            return None
        return vocab.encode(text)

    rng = random.Random(3)
    words = ["hi", " there", "\n\n", "  ", "<|end|>", "<tool_call>", "東京", "1.5e3", "a_b", "\t", "!", "x" * 40,
             "e\u0301", "😀", "\x1c"]  # fmt: skip

    def text() -> str:
        return "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))

    def message() -> dict:
        role = rng.choice(["system", "user", "assistant", "tool", "custom"])
        m: dict = {"role": role, "content": text()}
        shape = rng.random()
        if shape < 0.15:
            m["content"] = [{"type": "text", "text": text()}, {"type": "text", "text": text()}]
        elif shape < 0.2:
            m["content"] = [{"text": text()}]  # no type: the engine refuses it
        elif shape < 0.25:
            m["role"] = 7  # not a string: refused
        if role == "assistant" and rng.random() < 0.4:
            arguments = rng.choice(['{"q": "kv  cache"}', {"city": text()}, "not json", "", "[1]"])
            m["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]
        return m

    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    described = {"type": "function", "function": {"name": "s2", "description": "Find ünï", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}  # fmt: skip
    counter = ModelTokenizer(files(vocab.vocab_size))
    both = 0
    for _ in range(600):
        messages = [message() for _ in range(rng.randint(0, 6))]
        tools = rng.choice([None, [], [tool], [tool, described]])
        expected, counted = engine(messages, tools), counter.count(messages, tools)
        if expected is not None and counted is not None:
            both += 1
            assert counted == len(expected), (messages, tools)
            assert counter.count(messages, tools) == len(expected)  # and again, from what it remembered
            # The ids too (what the KV index hashes blocks from): the engine's own, hashed from its pieces.
            assert counter.measure(messages, tools, ids=True).ids == expected, (messages, tools)
    assert both > 100
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = engine(plain, [tool])
    assert expected is not None and counter.count(plain, [tool]) == len(expected)  # the common shapes are counted
