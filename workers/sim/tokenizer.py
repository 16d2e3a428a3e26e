r"""A deterministic word-level tokenizer and the chat template of the GPU-free engine.

Its token counts are what ``/tokenize`` returns and what ``usage`` reports, so the
gateway's l_hist / l_incr bookkeeping sees exactly what the engine's KV cache sees.
Two properties matter more than realism:

* **Compositional at message boundaries.** Special tokens are split out first and
  whitespace runs never swallow the space that starts a word, so the prompt of round
  k+1 starts with the prompt of round k followed by the tokens generated in round k.
  That is what makes prefix caching (and incremental prefill) work across rounds.
* **Stable ids.** A token's id is a hash of its text, the same in every process.

**Published as a model's files.** The engine publishes a ``tokenizer.json`` and a chat
template (:func:`files`) the way vLLM's supervisor publishes a served model's
(workers.vllm.tokenizer_files), so a gateway counts this engine's prompts as it counts
any vLLM model's, with the ``tokenizers`` library and a Jinja template, and needs none
of this engine's code. The ``tokenizer.json`` splits exactly where :meth:`Tokenizer.pieces`
does: one pattern, written with explicit character classes (:func:`_classes`) rather
than ``\s`` and ``\w``, whose meanings differ between Python's ``re`` and the
Oniguruma engine inside ``tokenizers``; its vocabulary is empty (every piece one unknown
token), since a count needs no ids. :data:`CHAT_TEMPLATE` renders what :func:`render_chat`
renders from a conversation as vLLM hands it to a template.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import unicodedata
from collections.abc import Sequence
from typing import Any

from surface.hashed_vocab import CONFIG_KEY, FIRST_ORDINARY_ID, piece_id

BOS = "<|begin_of_text|>"
START = "<|start|>"
END = "<|end|>"  # also the end-of-sequence token the engine generates
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
SPECIAL_TOKENS = (BOS, START, END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
SPECIAL_IDS = {text: i + 1 for i, text in enumerate(SPECIAL_TOKENS)}
EOS_ID = SPECIAL_IDS[END]
_MAX_REMEMBERED = 1 << 20
_BMP_END = 0xFFFF

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

# The chat template as a model ships it (transformers' environment: trim_blocks and
# lstrip_blocks, so every newline of the prompt is a string literal here).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{ '<|start|>tools\\n' }}{{ tools | tojson(sort_keys=True) }}{{ '<|end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{ '<tool_call>' }}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start|>assistant\\n' }}{%- endif -%}"
)


@functools.cache
def _classes() -> tuple[str, str]:
    """Bracket-expression bodies for word characters and for whitespace, as literal
    ranges, which mean the same to Python's ``re`` and to Oniguruma: whitespace is what
    ``str.isspace`` calls it; a word character is a letter, mark or number of the Basic
    Multilingual Plane, or any code point beyond it (emoji and rare scripts alike; one
    range there keeps ``re``'s class a fast bitmap)."""
    word, space = [], []
    for code in range(_BMP_END + 1):
        ch = chr(code)
        if ch.isspace():
            space.append(code)
        elif unicodedata.category(ch)[0] in "LMN":
            word.append(code)
    return _ranges(word) + f"{chr(_BMP_END + 1)}-{chr(sys.maxunicode)}", _ranges(space)


def _ranges(codes: list[int]) -> str:
    out, start = [], None
    for i, code in enumerate(codes):
        if start is None:
            start = code
        if i + 1 == len(codes) or codes[i + 1] != code + 1:
            out.append(_literal(start) if start == code else f"{_literal(start)}-{_literal(code)}")
            start = None
    return "".join(out)


def _literal(code: int) -> str:
    ch = chr(code)
    return "\\" + ch if ch in "\\]^-[" else ch


@functools.cache
def pieces_pattern() -> str:
    """GPT-2 style pieces: an optional leading space and a word, a punctuation run, an
    underscore run, or whitespace that is not immediately followed by a word (so " word"
    stays whole)."""
    word, space = _classes()
    return f" ?[{word}]+| ?[^{word}{space}_]+| ?_+|[{space}]+(?![^{space}])|[{space}]+"


class Tokenizer:
    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= FIRST_ORDINARY_ID:
            raise ValueError("vocab_size too small")
        self.vocab_size = vocab_size
        self._ids: dict[str, int] = dict(SPECIAL_IDS)
        self._pieces = re.compile(pieces_pattern())

    def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for segment in _SPECIAL_SPLIT.split(text):
            if not segment:
                continue
            if segment in SPECIAL_IDS:
                out.append(segment)
            else:
                out.extend(self._pieces.findall(segment))
        return out

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        return [ids.get(p) or self.piece_id(p) for p in self.pieces(text)]

    def piece_id(self, piece: str) -> int:
        """The id of one piece; remembered, since prompts repeat most of their pieces."""
        found = self._ids.get(piece)
        if found is not None:
            return found
        found = piece_id(piece, self.vocab_size)
        if len(self._ids) >= _MAX_REMEMBERED:
            self._ids = dict(SPECIAL_IDS)
        self._ids[piece] = found
        return found


def files(vocab_size: int) -> dict[str, Any]:
    """The tokenizer and chat template as a served model's files, in the form
    workers.vllm.tokenizer_files reads them from a model's folder: a ``tokenizer.json``
    that splits where :meth:`Tokenizer.pieces` does (a byte-level step after the split,
    which splits nothing, marks its pieces as independent of their neighbours, so a
    gateway counts a conversation message by message), the special tokens, a config
    saying that a piece's id is the hash of its text (surface.hashed_vocab), and
    :data:`CHAT_TEMPLATE`."""
    from tokenizers import AddedToken, Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as Files

    counter = Files(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    counter.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pieces_pattern()), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    counter.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return {
        "tokenizer": counter.to_str(),
        "config": {"bos_token": BOS, "eos_token": END, CONFIG_KEY: vocab_size},
        "chat_template": CHAT_TEMPLATE,
    }


def render_tool_call(name: str, arguments: Any) -> str:
    """Hermes-style tool-call text, the same when generated and when re-rendered (as the
    template's ``tojson`` writes it: non-ASCII characters as they are)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{call}{TOOL_CALL_CLOSE}"


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` as vLLM 0.32 hands it to a template that
    reads it as a string (``vllm.renderers.chat_utils``): a string, None, or a list of parts
    whose texts are joined by a newline, empty ones left out. A part without a text string
    (an image, a null text) adds nothing: vLLM skips such parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(t for part in content if isinstance(part, dict) and isinstance(t := part.get("text"), str) and t)


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
        listed = json.dumps([_tool(t) for t in tools], sort_keys=True, ensure_ascii=False)
        parts.append(f"{START}tools\n{listed}{END}\n")
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


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as vLLM's request model writes it for the template: its function's name,
    description and parameters (null when absent), nothing else."""
    fn = tool.get("function", {})
    return {"type": "function", "function": {"name": fn.get("name"), "description": fn.get("description"),
                                             "parameters": fn.get("parameters")}}  # fmt: skip


def _arguments(raw: Any) -> dict[str, Any]:
    """A tool call's arguments as vLLM hands them to the template: parsed from their JSON
    string, and ``{}`` where they are empty, not JSON, or not an object."""
    if isinstance(raw, str) and raw:
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return raw if isinstance(raw, dict) else {}
