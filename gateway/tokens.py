"""Counting a prompt's tokens in the gateway, with the engine's own code, where it can.

Every round needs its prompt's length (l_total, Eq. 1-2) before it is routed. Asking the
engine (``POST /tokenize``) puts an HTTP round trip on the critical path of every
round and spends the engine's CPU on it - the GPU-free engine runs on one core, so at
a few hundred streams every ``/tokenize`` is a token it does not generate. For the
GPU-free engine the gateway runs the engine's own tokenizer path instead: its request
model (workers.sim.protocol), its chat template and its tokenizer (workers.sim.tokenizer),
the three steps its ``/tokenize`` takes, so the count is the engine's by construction
(tests/test_gateway.py checks it against ``/tokenize``). An engine the gateway does not
know how to count for (vLLM: its model's tokenizer and chat template) is still asked.

An engine is known by what its ``GET /version`` says, asked once when the pool first
sees it (gateway.pool).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from workers.sim.protocol import SYSTEM_FINGERPRINT_PREFIX, EngineError, TokenizeChatRequest, message_dicts
from workers.sim.tokenizer import Tokenizer, render_chat

SIM_ENGINE = "ampd-sim"  # what the pool calls an engine whose count the gateway can make itself
# Pieces do not depend on the vocabulary (ids do, and are not needed): any size will do.
_TOKENIZER = Tokenizer(vocab_size=1 << 16)


def engine_kind(version: dict[str, Any]) -> str | None:
    """The tokenizer the gateway can run for an engine, from its ``/version`` answer; None
    when it has to ask the engine."""
    return SIM_ENGINE if str(version.get("version", "")).startswith(SYSTEM_FINGERPRINT_PREFIX) else None


def sim_prompt_tokens(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int | None:
    """The GPU-free engine's ``/tokenize`` count of a chat prompt, or None where the engine
    would refuse it: the caller then asks the engine, whose answer (the error, in its words)
    is the one the client must get."""
    body: dict[str, Any] = {"model": model, "messages": messages}
    if tools:
        body["tools"] = tools
    try:
        chat = TokenizeChatRequest.model_validate(body)
        text = render_chat(
            message_dicts(chat.messages),
            [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None,
            chat.add_generation_prompt,
            chat.continue_final_message,
        )
    except (ValidationError, ValueError, EngineError):
        return None
    return len(_TOKENIZER.pieces(text))
