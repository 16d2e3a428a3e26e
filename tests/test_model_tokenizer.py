"""The gateway's count of a vLLM engine's prompts (gateway.engines.model_tokenizer), the files its
supervisor publishes for it (workers.vllm.tokenizer_files), and the check that takes a
model whose count differs back to its engine (gateway.engines.tokens.ServedTokenizers).

The count against vLLM's own ``/tokenize`` is in tests/test_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from huggingface_hub import constants
from prometheus_client import CollectorRegistry, Counter
from tokenizers import Tokenizer

from gateway.engines.model_tokenizer import ModelTokenizer, _environment, _message, _tool
from gateway.engines.tokens import ServedTokenizers
from gateway.engines.upstream import EngineClient
from gateway.metrics import Family
from surface.registry import tokenizer_key
from tests import conversations
from tests.engines import start_sim_worker, stop
from workers.vllm import tiny_model, tokenizer_files
from workers.vllm.launch import VllmLaunch

REDIS_URL = "redis://127.0.0.1:6379/13"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model")


def files(model_dir: Path, chat_template: str | None = None) -> dict:
    return tokenizer_files.read(VllmLaunch(str(model_dir))) | {"chat_template": chat_template}


def rendered(tokenizer: ModelTokenizer, messages: list, tools: list | None) -> str:
    fmt = tokenizer._openai_format["default"]
    conversation = [_message(m, fmt) for m in messages]
    tool_dicts = [_tool(t) for t in tools] if tools else None
    return tokenizer._compiled["default"].render(
        messages=conversation, tools=tool_dicts, documents=None, add_generation_prompt=True, **tokenizer.variables
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "template", [None, conversations.STRING_TEMPLATE, conversations.AGENT_TEMPLATE], ids=["parts", "string", "agent"]
)
def test_pieces_between_added_tokens_add_up_to_the_whole_prompt(model_dir, template):
    """The count sums the pieces between the tokenizer's added tokens, each remembered: it
    equals encoding the rendered prompt whole, for rendered conversations and for strings
    dense with added tokens."""
    tokenizer = ModelTokenizer(files(model_dir, template))
    whole = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer._split is not None
    rng = random.Random(7)
    texts = [rendered(tokenizer, *conversations.conversation(rng)) for _ in range(150)]
    texts += ["".join(rng.choice(conversations.WORDS) for _ in range(rng.randint(0, 40))) for _ in range(500)]
    for text in texts:
        assert tokenizer.tokens(text) == len(whole.encode(text, add_special_tokens=False).ids), repr(text)
    messages, tools = conversations.conversation(rng)
    assert tokenizer.count(messages, tools) == len(whole.encode(rendered(tokenizer, messages, tools)).ids)


@pytest.mark.unit
@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "NFC"}},
        {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}},
    ],
    ids=["normalizer", "metaspace"],
)
def test_a_tokenizer_whose_pieces_could_interact_is_encoded_whole(model_dir, change):
    """A normalizer, or a pre-tokenizer that treats a text's first piece apart (Metaspace's
    "first"), could make a piece's tokens depend on what lies beyond it: such a tokenizer
    is encoded whole, and still counts what it encodes."""
    spec = json.loads((model_dir / "tokenizer.json").read_text()) | change
    tokenizer = ModelTokenizer(files(model_dir) | {"tokenizer": json.dumps(spec)})
    assert tokenizer._split is None
    whole = Tokenizer.from_str(json.dumps(spec))
    text = "<s>Paris</s> é 漢字 <tool_call>{}</tool_call>"
    assert tokenizer.tokens(text) == len(whole.encode(text, add_special_tokens=False).ids)


@pytest.mark.unit
def test_the_content_format_follows_the_template(model_dir):
    """As vLLM detects it: the tiny model's template loops over a message's content parts,
    so text stays in parts; a template that prints ``content`` reads one string."""
    parts, string = ModelTokenizer(files(model_dir)), ModelTokenizer(files(model_dir, conversations.STRING_TEMPLATE))
    agent = ModelTokenizer(files(model_dir, conversations.AGENT_TEMPLATE))
    assert parts._openai_format == {"default": True}
    assert string._openai_format == agent._openai_format == {"default": False}
    sliced = "{% for m in messages[1:] %}{% for p in m['content'] | list %}{{ p.text }}{% endfor %}{% endfor %}"
    assert ModelTokenizer(files(model_dir, sliced))._openai_format == {"default": True}
    user = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, "b"]}
    assert _message(user, True)["content"] == [{"type": "text", "text": t} for t in ("a", "", "b")]
    assert _message(user, False)["content"] == "a\nb"  # vLLM leaves an empty part out of the string


@pytest.mark.unit
def test_what_it_cannot_count_as_vllm_does_is_left_to_the_engine(model_dir):
    tokenizer = ModelTokenizer(files(model_dir))
    user = {"role": "user", "content": "hi"}
    assert tokenizer.count([user], None) is not None
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    for messages in ([image], [{"role": "developer", "content": "x"}, user],
                     [user, {"role": "assistant", "content": "a", "reasoning": "r"}, user]):  # fmt: skip
        assert tokenizer.count(messages, None) is None
    deferred = dict(conversations.TOOLS[0], defer_loading=True)
    assert tokenizer.count([user], [deferred]) is None
    failing = "{{ raise_exception('no') }}"
    assert ModelTokenizer(files(model_dir, failing)).count([user], None) is None  # the engine's error is the client's


@pytest.mark.unit
def test_named_templates_take_the_tool_use_one_for_tools(model_dir):
    """A tokenizer_config.json with named templates: transformers takes "tool_use" where
    the request has tools, else "default"."""
    named = [
        {"name": "default", "template": "{{ bos_token }}plain"},
        {"name": "tool_use", "template": "{{ bos_token }}x"},
    ]
    config = json.loads((model_dir / "tokenizer_config.json").read_text()) | {"chat_template": named}
    tokenizer = ModelTokenizer(files(model_dir) | {"config": config})
    user = [{"role": "user", "content": "hi"}]
    assert tokenizer.count(user, None) == tokenizer.tokens("<s>plain")
    assert tokenizer.count(user, conversations.TOOLS) == tokenizer.tokens("<s>x") == 2
    assert _environment().from_string("{{ x | tojson }}").render(x={"é": 1}) == '{"é": 1}'  # not ASCII-escaped


@pytest.mark.unit
def test_the_supervisor_publishes_what_vllm_counts_with(model_dir, tmp_path, monkeypatch):
    """The model's folder, or its snapshot in the Hugging Face cache (huggingface_hub's own
    layout, never downloaded); nothing where vLLM's arguments change the count."""
    read = tokenizer_files.read(VllmLaunch(str(model_dir)))
    assert read["tokenizer"] == (model_dir / "tokenizer.json").read_text() and read["chat_template"] is None
    assert read["config"]["bos_token"] == "<s>"
    for args in (("--chat-template", "t.jinja"), ("--tokenizer=other",), ("--trust-remote-code",)):
        assert tokenizer_files.read(VllmLaunch(str(model_dir), extra_args=args)) is None
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).write_text((model_dir / name).read_text())
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert tokenizer_files.model_folder("org/tiny") == snapshot
    assert tokenizer_files.read(VllmLaunch("org/tiny")) == read
    assert tokenizer_files.model_folder("org/absent") is None


def test_a_model_whose_count_differs_from_its_engine_is_counted_by_the_engine(model_dir, tmp_path):
    """The tiny model's files published under the name of a GPU-free engine's model, whose
    own tokenizer counts otherwise: the gateway counts with them once loaded, its check
    finds the engine's count different, and from then on the engine is asked."""
    engine = start_sim_worker(tmp_path)
    prefix = f"mt-{time.monotonic_ns()}"

    async def run() -> list[int | None]:
        redis = aioredis.from_url(REDIS_URL, decode_responses=True)
        client = EngineClient(30.0)
        checks = Family(Counter("checks", "", ["result"], registry=CollectorRegistry()))
        await redis.set(tokenizer_key(prefix, engine.model), json.dumps(files(model_dir)))
        tokenizers = ServedTokenizers(redis, prefix, client, checks)
        messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
        counts = [tokenizers.count(engine.model, engine.url, messages, None)]  # not loaded yet
        deadline = time.monotonic() + 30
        while (counted := tokenizers.count(engine.model, engine.url, messages, None)) is None:
            assert time.monotonic() < deadline, "the published files were not loaded"
            await asyncio.sleep(0.05)
        counts.append(counted.tokens)
        while tokenizers.count(engine.model, engine.url, messages, None) is not None:
            assert time.monotonic() < deadline, "the check did not take the model back to its engine"
            await asyncio.sleep(0.05)
        counts.append(await client.tokenize(engine.url, engine.model, messages, None))
        counts.append(checks.labels("differs")._value.get())
        await client.close()
        await redis.delete(tokenizer_key(prefix, engine.model))
        await redis.aclose()
        return counts

    try:
        before, local, engines, differs = asyncio.run(run())
    finally:
        stop(engine)
    assert before is None and local != engines and differs >= 1  # one per count made while the first check ran
