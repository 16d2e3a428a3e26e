"""A vLLM engine's prompt count, made in the gateway with the served model's own tokenizer
and chat template, as vLLM applies them for ``POST /tokenize``.

The files come from the engine's supervisor, which publishes them in Redis
(workers.vllm.tokenizer_files); the gateway loads them once per model. The count then
saves every round of a vLLM engine one HTTP round trip before it is routed.

What vLLM 0.32 makes of a chat request before the template sees it
(``vllm.renderers.chat_utils``, ``vllm.renderers.hf``), and what is done here alike:

* a message's text parts are joined by a newline (empty ones left out) where the template
  reads ``content`` as a string; where it loops over it (vLLM's "openai" content format, detected from the
  template's syntax tree), text stays a list of ``{"type": "text", "text": ...}`` parts,
  a string content included;
* a tool message's content is always a string, its text parts joined by a newline;
* an assistant's tool calls reach the template with their ``arguments`` parsed from JSON
  (``{}`` where empty, not JSON or not an object), and an empty list of calls is dropped;
* tools are as vLLM's request model writes them: ``type``, then ``function`` with
  ``name``, ``description`` (null when absent) and ``parameters``.

Then transformers' ``apply_chat_template``: a sandboxed Jinja environment (``trim_blocks``,
``lstrip_blocks``, loop controls, its own ``tojson``, ``raise_exception``,
``strftime_now``), the tokenizer's special tokens as variables, ``add_generation_prompt``,
and the rendered text tokenized without special tokens added. A request holding anything
else - a content part other than text, a ``developer`` or ``function`` message, an
unparsable tool - gives None, and the engine is asked, as is any model whose template
fails to render: the engine's answer (its error included) is the one that counts.

**Incremental.** Encoding a whole conversation every round would cost the gateway what
it saves the engine: a byte-level BPE is slow beside a round's other work. The tokenizer splits its input
on its added tokens (``<|eot_id|>``, ``<|im_end|>``, ...) before anything else and
tokenizes each piece between them on its own, so a prompt's count is the sum of its
pieces' counts plus one per added token. Pieces are counted once and remembered by their
digest, so a session's next round encodes only what is new: its tool results and the
last reply. That holds where nothing looks across a piece's edge: no normalizer, a
byte-level pre-tokenizer (Llama 3, Qwen, Mistral's Tekken, GPT-2 style), and added tokens
that strip no whitespace; any other tokenizer is encoded whole.

**Checked.** vLLM's preprocessing changes between releases, and chat templates vary, so
the gateway does not take this on trust: the first counts of every model, and one in
``CHECK_EVERY`` after, are also asked of the engine, off the round's path
(gateway.engines.tokens.ServedTokenizers), and a model whose count ever differs is counted by its engine
from then on.
"""

from __future__ import annotations

import functools
import json
import re
from array import array
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.remembered import Remembered
from surface.hashed_vocab import CONFIG_KEY, piece_id

CHECK_FIRST = 32  # counts of a model checked against its engine before sampling starts
CHECK_EVERY = 256  # ... then one in this many
MESSAGES_KEPT = 8192  # messages remembered as the template takes them, per content format
PIECE_IDS_KEPT = 4096  # pieces whose token ids are remembered (a piece is mostly one message)
_TEXT_PART_KEYS = {"type", "text"}
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips this line from system messages


class Unsupported(ValueError):
    """The model's files hold something this counter does not do as vLLM does."""


@dataclass(frozen=True, slots=True)
class Counted:
    """A prompt's count, with its token ids where they were asked for and the files give them."""

    tokens: int
    ids: list[int] | None = None


class ModelTokenizer:
    def __init__(self, files: dict[str, Any]) -> None:
        """``files``: ``tokenizer`` (tokenizer.json's text), ``config`` (tokenizer_config.json)
        and ``chat_template`` (chat_template.jinja's text, or None), as
        workers.vllm.tokenizer_files reads them."""
        self.tokenizer = Tokenizer.from_str(files["tokenizer"])
        config = files["config"]
        templates = files.get("chat_template") or config.get("chat_template")
        if isinstance(templates, list):  # named templates: transformers picks "tool_use" for tools
            templates = {t["name"]: t["template"] for t in templates}
        if not templates:
            raise Unsupported("the model has no chat template")
        self._templates = templates if isinstance(templates, dict) else {"default": templates}
        env = _environment()
        self._compiled = {name: env.from_string(text) for name, text in self._templates.items()}
        self._openai_format = {name: _loops_over_content(env.parse(text)) for name, text in self._templates.items()}
        self.variables = {
            key: _token_text(config[key])
            for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
            if config.get(key) is not None
        }
        spec = json.loads(files["tokenizer"])
        self._split = _piece_splitter(spec)
        self._piece = Remembered(self._encoded)
        # Ids are wanted for the prompt's prefix-cache blocks: kept as 4-byte arrays, fewer of them.
        self._piece_ids = Remembered(self._encoded_ids, PIECE_IDS_KEPT)
        self._added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
        self._hashed_vocab = config.get(CONFIG_KEY)  # ids hashed from the pieces' texts (surface.hashed_vocab)
        self.gives_ids = self._hashed_vocab is not None or _gives_ids(spec)
        # A session's messages come back every round: each is made over once, in each format.
        # The table holds the messages themselves, so it is kept smaller than the pieces' counts.
        self._message = {fmt: Remembered(functools.partial(_message, openai_format=fmt), MESSAGES_KEPT)
                         for fmt in (False, True)}  # fmt: skip
        self.counted = 0  # counts made, for the check's sampling

    # -- the count --------------------------------------------------------------------
    def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int | None:
        """The prompt's tokens as the engine's ``/tokenize`` counts them, or None where this
        counter does not know what the engine makes of the request."""
        counted = self.measure(messages, tools)
        return None if counted is None else counted.tokens

    def measure(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, ids: bool = False
    ) -> Counted | None:
        """The prompt's count, and its token ids where ``ids`` and the files give them: the
        ids as the engine prefills them, what its prefix-cache blocks are hashed from
        (gateway.engines.kv_index). The files may give counts but no ids (a vocabulary of the
        unknown token alone, unless the config says the ids are hashed from the pieces:
        surface.hashed_vocab). The template, the costliest part for a long prompt, is
        rendered once for both. None where the count is not known."""
        text = self._render(messages, tools)
        if text is None:
            return None
        self.counted += 1
        if ids and self.gives_ids:
            token_ids = self.ids(text)
            return Counted(len(token_ids), token_ids)
        return Counted(self.tokens(text))

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
        """The prompt's text as vLLM renders it, or None (see the module's docstring)."""
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        if name not in self._compiled:
            return None
        conversation = list(map(self._message[self._openai_format[name]], messages))
        tool_dicts = [_tool(t) for t in tools] if tools else None
        if not conversation or None in conversation or (tool_dicts is not None and None in tool_dicts):
            return None
        try:
            return self._compiled[name].render(
                messages=conversation, tools=tool_dicts, documents=None, add_generation_prompt=True, **self.variables
            )
        except Exception:  # what a template raises is its own (raise_exception, a bad filter, ...)
            return None  # the engine then answers for it, in its own words

    def tokens(self, text: str) -> int:
        """``text``'s tokens, special tokens matched and none added."""
        if self._split is None:
            return self._encoded(text)
        pieces = self._split.split(text)
        return sum(self._piece(piece) for piece in pieces if piece) + len(pieces) - 1

    def ids(self, text: str) -> list[int]:
        """``text``'s token ids, special tokens matched and none added: the pieces between
        added tokens encoded once each and remembered, as for the count."""
        if self._split is None:
            return list(self._encoded_ids(text))
        out: list[int] = []
        start = 0
        for match in self._split.finditer(text):
            if match.start() > start:
                out.extend(self._piece_ids(text[start : match.start()]))
            out.append(self._added[match.group()])
            start = match.end()
        if start < len(text):
            out.extend(self._piece_ids(text[start:]))
        return out

    def checking(self) -> bool:
        """Whether the count just made should also be asked of the engine."""
        return self.counted <= CHECK_FIRST or self.counted % CHECK_EVERY == 0

    def _encoded(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _encoded_ids(self, text: str) -> array[int]:
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        if self._hashed_vocab is None:
            return array("I", encoding.ids)
        return array("I", (piece_id(text[start:end], self._hashed_vocab) for start, end in encoding.offsets))


# -- the request, as vLLM hands it to the template ------------------------------------------
def _message(raw: dict[str, Any], openai_format: bool) -> dict[str, Any] | None:
    role = raw.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        return None
    texts = _texts(raw.get("content"))
    if texts is None or (role == "system" and any(t.startswith(_BILLING_HEADER) for t in texts)):
        return None
    message: dict[str, Any] = {"role": role}
    if not openai_format:  # vLLM keeps a part only if what it parsed is truthy: an empty string is not
        message["content"] = "\n".join(t for t in texts if t)
    elif role == "tool":
        message["content"] = "\n".join(texts)
    else:
        message["content"] = [{"type": "text", "text": t} for t in texts]
    if role == "assistant":
        calls = raw.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                return None
            if calls:
                parsed = [_call(c) for c in calls]
                if None in parsed:
                    return None
                message["tool_calls"] = parsed
        if raw.get("reasoning") is not None:
            return None  # vLLM passes it on under two names; not counted here
    if role == "tool" and "tool_call_id" in raw:
        message["tool_call_id"] = raw["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(raw.get(key), str):
            message[key] = raw[key]
    return message


def _texts(content: Any) -> list[str] | None:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and set(part) == _TEXT_PART_KEYS:
            if not isinstance(part["text"], str):
                return None
            texts.append(part["text"])
        else:
            return None
    return texts


def _call(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        return None
    function = raw.get("function")
    if not isinstance(function, dict):
        return None
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        arguments = {}
    return {**raw, "function": {**function, "arguments": arguments}}


def _tool(raw: dict[str, Any]) -> dict[str, Any] | None:
    function = raw.get("function")
    if raw.get("type", "function") != "function" or not isinstance(function, dict):
        return None
    if not isinstance(function.get("name"), str) or raw.get("defer_loading") is not None:
        return None
    if function.get("strict") is not None or function.get("defer_loading") is not None:
        return None
    return {
        "type": "function",
        "function": {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        },
    }


# -- the template ---------------------------------------------------------------------------
def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' environment for chat templates (``_compile_jinja_template``)."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """vLLM's content-format detection, on the template's syntax tree: "openai" (True)
    where it loops over a message's ``content`` (or a variable named ``content``), else
    "string"."""
    messages = {"messages"} | {a.target.name for a in root.find_all(jinja2.nodes.Assign)
                               if isinstance(a.target, jinja2.nodes.Name) and _reads(a.node, {"messages"})}  # fmt: skip
    items = {f.target.name for f in root.find_all(jinja2.nodes.For)
             if isinstance(f.target, jinja2.nodes.Name) and _reads(f.iter, messages)}  # fmt: skip
    in_macros = {id(f) for m in root.find_all(jinja2.nodes.Macro) for f in m.find_all(jinja2.nodes.For)}
    for loop in root.find_all(jinja2.nodes.For):
        if _reads(loop.iter, items, "content"):
            return True
        if id(loop) not in in_macros and isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            return True
    return False


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """``node`` is one of ``names`` (or its ``key``), through filters, tests and slices."""
    while True:
        filtered = isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None
        if not (filtered or isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
            break
        node = node.node
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name in names
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and isinstance(node.node, jinja2.nodes.Name) and node.node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        return (isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
                and isinstance(node.node, jinja2.nodes.Name) and node.node.name in names)  # fmt: skip
    return False


def _token_text(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


# -- the pieces -------------------------------------------------------------------------------
def _piece_splitter(spec: dict[str, Any]) -> re.Pattern[str] | None:
    """A pattern matching the added tokens, leftmost and longest first, as the tokenizer
    splits on them; None where a piece's tokens could depend on what lies beyond its edges."""
    if spec.get("normalizer") is not None or not _byte_level(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if not added or any(t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word")
                        for t in added):  # fmt: skip
        return None
    contents = sorted({t["content"] for t in added}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, contents)))


def _gives_ids(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer's ids are the engine's: not where its vocabulary is one entry
    (the unknown token), which counts pieces but names none of them."""
    vocab = (spec.get("model") or {}).get("vocab")
    return not (isinstance(vocab, dict | list) and len(vocab) <= 1)


def _byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    """A byte-level pre-tokenizer, alone or after regex splits."""
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer["pretokenizers"] if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    kinds = [s.get("type") for s in steps]
    return "ByteLevel" in kinds and set(kinds) <= {"ByteLevel", "Split"}
