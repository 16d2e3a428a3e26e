"""A request's prompt as the engine reads it: the chat template rendered, or a completion's
text or token ids, shared by the generation routes and /tokenize."""

from __future__ import annotations

from typing import Any

from workers.sim import protocol as p
from workers.sim.tokenizer import BOS, render_chat
from workers.sim.worker import SimWorker


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    ending: p.ChatCompletionRequest | p.TokenizeChatRequest,
) -> str:
    """The chat template; what it rejects is the client's error, as in vLLM."""
    try:
        return render_chat(messages, tools, ending.add_generation_prompt, ending.continue_final_message)
    except ValueError as exc:
        raise p.EngineError(400, str(exc)) from exc


def tool_dicts(tools: list[p.Tool] | None) -> list[dict[str, Any]] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def completion_prompt(w: SimWorker, body: p.CompletionRequest) -> tuple[str, list[int]]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise p.EngineError(400, "the GPU-free engine takes one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, w.encode_prompt(BOS + prompt)
    if not prompt or any(not 0 <= t < w.tokenizer.vocab_size for t in prompt):
        raise p.EngineError(400, "prompt token ids must be non-empty and inside the vocabulary", param="prompt")
    return " ".join(map(str, prompt)), list(prompt)
