"""Split requests on vLLM: ampd's connector (workers.vllm.connector) on real engines, real NIXL.

A split prefills a prompt's head on one engine and the rest on the other, which pulls the
head's KV (rounds.split_point; DynaServe's micro-requests). The prefill engine gets the
chat request with ``split_at`` in its ``kv_transfer_params``, as the gateway sends it, and
the decode engine that engine's answer. Checked on vLLM's CPU build with a tiny Llama whose
seeded random weights make its greedy answer depend on every token it attends to
(workers.vllm.tiny_model --weights), in float32: the split pulls exactly the head's
blocks (vLLM's NIXL byte counter, in blocks measured by a whole hand-off), and the decode
engine then says token for token what one engine says alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from surface.wire import prefill_params
from tests.engines import Engine
from tests.test_vllm import VLLM_TIMEOUT, registered, weighted_pair

pytestmark = VLLM_TIMEOUT
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "2048")
PULLED, FAILED = "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_failed_transfers_total"
SAY = 12  # tokens each answer says


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[tuple[Engine, Engine]]:
    """(prefill engine, decode engine): both `kv_both` with ampd's connector (which comes with
    ampd's scheduler, its target off), registered as running splits."""
    prefix = f"vllm-split-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("vllm-split")
    with weighted_pair(tmp, prefix, ("first", "second"), VLLM_ARGS) as (first, second):
        assert all(info.splits for info in registered(prefix).values())
        yield first, second


def messages_of(words: int) -> list[dict]:
    """A user message no earlier request began with (nothing of it cached on either engine)."""
    text = " ".join(f"fact{i % 97} holds" for i in range(words))
    return [{"role": "user", "content": f"Case {uuid.uuid4().hex}. {text}"}]


def chat(engine: Engine, messages: list[dict], max_tokens: int, **extra) -> dict:
    body = {"model": engine.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    response = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=240)
    assert response.status_code == 200, response.text
    return response.json()


def handed_off(prefill: Engine, decode: Engine, messages: list[dict], split_at: int | None) -> tuple[dict, dict, float]:
    """Prefill on one engine (the whole prompt, or its first ``split_at`` tokens), decode on the
    other: the prefill's params, the decode's answer and the bytes it pulled over NIXL."""
    params = chat(prefill, messages, 1, kv_transfer_params=prefill_params(split_at))["kv_transfer_params"]
    before = decode.metrics()
    answer = chat(decode, messages, SAY, kv_transfer_params=params)
    after = decode.metrics_once(lambda m: m[PULLED] > before[PULLED])
    assert after[FAILED] == before[FAILED]
    return params, answer, after[PULLED] - before[PULLED]


def test_a_split_request_pulls_the_heads_blocks_and_says_what_an_unsplit_one_says(engines):
    first, second = engines
    block = second.block_size
    whole, _, whole_bytes = handed_off(first, second, messages_of(80), None)
    blocks = len(whole["remote_block_ids"][0])
    assert whole_bytes > 0 and whole_bytes % blocks == 0
    block_bytes = whole_bytes // blocks

    for heads in (1, 2):  # the head's blocks: the split point one and two blocks in
        messages = messages_of(80)
        alone = chat(first, messages, SAY)  # one engine, no hand-off
        split_at = heads * block
        assert alone["usage"]["prompt_tokens"] > split_at + block  # the decode engine prefills whole blocks too
        params, split, pulled = handed_off(first, second, messages, split_at)
        assert params["remote_num_tokens"] == split_at and len(params["remote_block_ids"][0]) == heads
        assert pulled == heads * block_bytes  # the head came over; the rest was computed there
        assert split["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"], heads
        assert split["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]


def test_a_split_point_vllm_cannot_honour_prefills_the_whole_prompt(engines):
    """Off the block grid, or past the prompt: the engine core cannot refuse a request (the
    GPU-free engine answers 400), so the prefill engine prefills it all, as unsplit."""
    first, second = engines
    block = second.block_size
    for split_at in (block + 1, 4096):
        messages = messages_of(40)
        params, answer, pulled = handed_off(first, second, messages, split_at)
        assert params["remote_num_tokens"] == answer["usage"]["prompt_tokens"]
        assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // block)
        assert pulled > 0
