"""Hand-offs of one request between two vLLM engines that only ampd makes: split requests
and a request continued mid-decode, on real engines over real NIXL.

## Split requests

Split requests on vLLM: ampd's connector (workers.vllm.connector) on real engines, real NIXL.

A split prefills a prompt's head on one engine and the rest on the other, which pulls the
head's KV (rounds.split_point; DynaServe's micro-requests). The prefill engine gets the
chat request with ``split_at`` in its ``kv_transfer_params``, as the gateway sends it, and
the decode engine that engine's answer. Checked on vLLM's CPU build with a tiny Llama whose
seeded random weights make its greedy answer depend on every token it attends to
(workers.vllm.tiny_model --weights), in float32: the split pulls exactly the head's
blocks (vLLM's NIXL byte counter, in blocks measured by a whole hand-off), and the decode
engine then says token for token what one engine says alone.

## Mid-decode hand-offs

A request handed from one vLLM engine to another in the middle of its decode, over NIXL.

DynaServe's micro-requests ("DynaServe: Unified and Elastic Execution for Dynamic
Disaggregated LLM Serving", section 3) split a request at any token: alpha runs on one
engine and beta continues on another from alpha's KV. vLLM 0.32's NixlConnector can
express the split inside the decode phase with nothing but its ordinary parameters:

* alpha is a prefill request (``do_remote_decode``) that is allowed ``d`` tokens instead
  of one. The prefill engine holds its blocks when it finishes by length or by a stop,
  and reports ``remote_num_tokens`` = its computed tokens: the prompt plus d - 1 (the
  last sampled token has no KV yet).
* beta is a decode request whose prompt is the prompt plus alpha's d tokens, with
  alpha's ``kv_transfer_params``. The decode engine pulls KV for its prompt and, as for any
  hand-off, computes the last prompt token itself - here alpha's last token, whose KV
  alpha never computed.
* Except where alpha's computed tokens (prompt + d - 1) fill their last block exactly: the
  decode engine allocates blocks for its whole prompt, one more than alpha holds, and its
  NIXL worker asserts there are enough (``_apply_prefix_caching``) - seen in a run here,
  the assertion kills the decode engine's core (EngineDeadError, every later request a
  500). A gateway must pick d so that prompt + d - 1 is not a multiple of the block size;
  that case is not run here, as it takes the engine down.

Checked here on vLLM's CPU build with a tiny Llama whose seeded random weights make its
greedy answer depend on every token it attends to (workers.vllm.tiny_model --weights),
in float32: alpha's tokens followed by beta's are the tokens one engine says alone, the
KV arrived over NIXL (vLLM's transfer counters), and the same hand-off from the held
blocks in the wrong order says something else - so the check can tell right KV from wrong.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from surface.wire import prefill_params
from tests import test_engine_protocol as protocol
from tests.engines import Engine
from tests.test_vllm import QUICK_START, VLLM_TIMEOUT, registered, weighted_pair

pytestmark = VLLM_TIMEOUT
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "2048", *QUICK_START)
PULLED, FAILED = "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_failed_transfers_total"
SAY = 12  # tokens each answer says
PULLS = "vllm:nixl_xfer_time_seconds_count"
AFTER = 12  # tokens beta says after alpha's (mid-decode hand-offs)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[tuple[Engine, Engine]]:
    """(prefill engine, decode engine): both `kv_both` with ampd's connector (which comes with
    ampd's scheduler, its target off), registered as running splits; the tiny Llama with its
    own weights. One pair serves the splits and the mid-decode hand-offs: each case prompts
    with text no earlier one began with, so nothing of it is cached on either engine."""
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


# -- a request continued on another engine in the middle of its decode -------------------


def complete(engine: Engine, prompt: list[int], max_tokens: int, **extra) -> tuple[list[int], dict | None]:
    """Greedy token ids for ``prompt`` (token ids), and the response's kv_transfer_params."""
    body = {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["token_ids"], answer.get("kv_transfer_params")


def prompt_of(engine: Engine, length: int) -> list[int]:
    """``length`` token ids of a prompt no earlier request began with (nothing cached)."""
    text = f"Case {uuid.uuid4().hex}: what is the weather in Oslo? Call get_weather, then answer. "
    response = httpx.post(f"{engine.url}/tokenize", json={"model": engine.model, "prompt": text * 64}, timeout=60)
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    assert len(tokens) >= length
    return tokens[:length]


def test_a_request_continues_on_another_engine_from_the_kv_of_its_first_tokens(engines):
    alpha_engine, beta_engine = engines
    block = beta_engine.block_size
    # Each case its own prompt, and the answer to compare with said by alpha's engine alone:
    # beta's engine has never seen the prompt, so every block it needs comes over NIXL.
    # Alpha's computed tokens (prompt + d - 1) end inside the second block for d = 2 and 3
    # (one slot short of filling it) and reach into a third for d = 5; d = 4 would fill it.
    for d in (2, 3, 5):
        prompt = prompt_of(alpha_engine, 2 * block - 3)
        alone, _ = complete(alpha_engine, prompt, d + AFTER)
        alpha, params = complete(alpha_engine, prompt, d, kv_transfer_params=protocol.NIXL_PARAMS)
        assert params is not None and params["remote_num_tokens"] == len(prompt) + d - 1, params
        assert len(params["remote_block_ids"][0]) == -(-(len(prompt) + d - 1) // block)
        assert alpha == alone[:d]
        before = beta_engine.metrics()[PULLS]
        beta, _ = complete(beta_engine, prompt + alpha, AFTER, kv_transfer_params=params)
        assert beta_engine.metrics_once(lambda m, before=before: m[PULLS] > before)[PULLS] == before + 1
        assert alpha + beta == alone, (d, alpha + beta, alone)

    # The control: the same hand-off reading alpha's held blocks in the wrong order.
    prompt = prompt_of(alpha_engine, 2 * block - 3)
    alone, _ = complete(alpha_engine, prompt, 5 + AFTER)
    alpha, params = complete(alpha_engine, prompt, 5, kv_transfer_params=protocol.NIXL_PARAMS)
    blocks = params["remote_block_ids"][0]
    shuffled = dict(params, remote_block_ids=[blocks[::-1]])
    beta, _ = complete(beta_engine, prompt + alpha, AFTER, kv_transfer_params=shuffled)
    assert alpha == alone[:5] and alpha + beta != alone
