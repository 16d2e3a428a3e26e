"""A deterministic word-level tokenizer and the chat template of the GPU-free engine.

Its token counts are what ``/tokenize`` returns and what ``usage`` reports, so the
gateway's l_hist / l_incr bookkeeping sees exactly what the engine's KV cache sees.
Two properties matter more than realism:

* **Compositional at message boundaries.** Special tokens are split out first and
  whitespace runs never swallow the space that starts a word, so the prompt of round
  k+1 starts with the prompt of round k followed by the tokens generated in round k.
  That is what makes prefix caching (and incremental prefill) work across rounds.
* **Stable ids.** A token's id is a hash of its text, the same in every process.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

BOS = "<|begin_of_text|>"
START = "<|start|>"
END = "<|end|>"  # also the end-of-sequence token the engine generates
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
SPECIAL_TOKENS = (BOS, START, END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
SPECIAL_IDS = {text: i + 1 for i, text in enumerate(SPECIAL_TOKENS)}
EOS_ID = SPECIAL_IDS[END]
_FIRST_ORDINARY_ID = 256
_MAX_REMEMBERED = 1 << 20

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
# GPT-2 style pieces: an optional leading space and a word, a punctuation run, or
# whitespace that is not immediately followed by a word (so " word" stays whole).
_PIECES = re.compile(r" ?[^\W_]+| ?[^\s\w]+| ?_+|\s+(?!\S)|\s+")


class Tokenizer:
    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= _FIRST_ORDINARY_ID:
            raise ValueError("vocab_size too small")
        self.vocab_size = vocab_size
        self._ids: dict[str, int] = dict(SPECIAL_IDS)

    def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for segment in _SPECIAL_SPLIT.split(text):
            if not segment:
                continue
            if segment in SPECIAL_IDS:
                out.append(segment)
            else:
                out.extend(_PIECES.findall(segment))
        return out

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        return [ids.get(p) or self.piece_id(p) for p in self.pieces(text)]

    def piece_id(self, piece: str) -> int:
        """The id of one piece; remembered, since prompts repeat most of their pieces."""
        found = self._ids.get(piece)
        if found is not None:
            return found
        digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
        found = _FIRST_ORDINARY_ID + int.from_bytes(digest, "little") % (self.vocab_size - _FIRST_ORDINARY_ID)
        if len(self._ids) >= _MAX_REMEMBERED:
            self._ids = dict(SPECIAL_IDS)
        self._ids[piece] = found
        return found


def render_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """Hermes-style tool-call text, the same when generated and when re-rendered."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_CLOSE}"


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, None, or a list of parts. A part
    without a text string (an image, a null text) adds nothing: vLLM skips such parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(t for part in content if isinstance(part, dict) and isinstance(t := part.get("text"), str))


def render_chat(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text for a chat request (the engine's chat template).

    An assistant turn renders as its content followed by its tool calls and END, the
    exact text the engine generates for it, so a conversation's next request extends
    the previous prompt plus output. With ``continue_final_message`` the last message
    stays open (no END): the engine goes on writing it, and the prompt is the original
    round's prompt followed by the text already generated.
    """
    if continue_final_message and add_generation_prompt:  # transformers' words, which vLLM passes on
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when "
            "you want the model to continue the final message, and add_generation_prompt when you want to add a "
            "header that will prompt it to start a new assistant message instead."
        )
    parts = [BOS]
    if tools:
        parts.append(f"{START}tools\n{json.dumps(list(tools), sort_keys=True)}{END}\n")
    for m in messages:
        role = m.get("role", "")
        text = message_text(m.get("content"))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            text += render_tool_call(fn.get("name", ""), _arguments(fn.get("arguments")))
        parts.append(f"{START}{role}\n{text}{END}\n")
    if continue_final_message:
        parts[-1] = parts[-1].removesuffix(f"{END}\n")
    elif add_generation_prompt:
        parts.append(f"{START}assistant\n")
    return "".join(parts)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments arrive as a JSON string (OpenAI format); keep them parsed."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw if raw is not None else {}
