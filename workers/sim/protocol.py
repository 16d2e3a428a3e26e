"""Request schemas and response shapes of vLLM's OpenAI server (as of vLLM 0.32).

Shapes follow vllm/entrypoints/openai/{chat_completion,completion}/protocol.py:
non-streaming bodies carry every field (nulls included); stream chunks carry the
fields vLLM sets explicitly. Unknown request fields are accepted and ignored, as
vLLM's ``OpenAIBaseModel`` (``extra="allow"``) does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.sim.responder import Reply, SimScript

SYSTEM_FINGERPRINT_PREFIX = "ampd-sim-0.1.0"


class EngineError(Exception):
    """An error with an OpenAI-shaped body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, self.param)


def error_body(status: int, message: str, type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": status}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Message(_Request):
    role: str  # vLLM renders any role its chat template takes (a custom message), not only OpenAI's
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def message_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """A conversation as the chat template takes it, refused where vLLM 0.32 refuses it: no
    message at all, or a content part without its ``type`` (a typed part it cannot read,
    such as a null text, it skips: ``tokenizer.message_text``)."""
    if not messages:  # vLLM's words, and no param
        raise EngineError(400, "Cannot apply chat template to an empty conversation. Provide at least one message.")
    for message in messages:
        if isinstance(message.content, list) and any("type" not in part for part in message.content):
            raise EngineError(400, "Missing 'type' field in multimodal part. (parameter=type)", param="type")
    return [m.model_dump(exclude_none=True) for m in messages]


class FunctionDef(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class _Generation(_Request):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    kv_transfer_params: dict[str, Any] | None = None
    sim_script: SimScript | None = None
    # vLLM's: salts the prefix cache so that only requests with the same salt share blocks.
    cache_salt: str | None = Field(default=None, min_length=1)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _ChatTemplate(_Request):
    """How the chat template ends the prompt: open a new assistant turn, or continue the
    last message (both at once is the template's error: workers.sim.tokenizer.render_chat)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


class ChatCompletionRequest(_ChatTemplate, _Generation):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def effective_tool_choice(self) -> Any:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def parses_tools(self) -> bool:
        """Whether vLLM's tool parser runs (it changes the shape of empty deltas)."""
        return bool(self.tools) and self.effective_tool_choice != "none"


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = None
    echo: bool = False


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplate):
    model: str | None = None
    messages: list[Message]

    @model_validator(mode="before")
    @classmethod
    def _one_ending(cls, data: Any) -> Any:
        """vLLM's check on what the client set itself (a default does not count), in its words."""
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data

    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None


# -- responses ---------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int | None = None  # set when prompt-token details are enabled

    def body(self, details: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if details:
            out["prompt_tokens_details"] = None if self.cached_tokens is None else {"cached_tokens": self.cached_tokens}
            out["completion_tokens_details"] = None
        return out

    def counts_json(self) -> str:
        """``body(details=False)`` as compact JSON, written directly: it goes into every
        chunk of a stream that asks for ``continuous_usage_stats``."""
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return f'{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},"completion_tokens":{completion}}}'

    def final_stream_body(self) -> dict[str, Any]:
        """A stream's last usage chunk: vLLM drops the None fields there, keeping cached tokens when counted."""
        out = self.body(details=False)
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


@dataclass
class ResponseIds:
    """Ids and timestamps one response shares across all its chunks."""

    id: str
    model: str
    chunk_object: str  # "chat.completion.chunk" or "text_completion"
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = SYSTEM_FINGERPRINT_PREFIX
    chunk_head: str | None = None  # cached by delta_chunk_sse


def chat_message(reply: Reply, text: str, tool_choice: Any, parses_tools: bool) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if parses_tools and reply.tool_calls:
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        message["content"] = reply.content if forced else (reply.content if reply.content.strip() else None)
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    message["reasoning"] = None
    return message


def chat_finish_reason(engine_reason: str, reply: Reply, tool_choice: Any, parses_tools: bool, stream: bool) -> str:
    """vLLM's mapping: parsed tool calls turn 'stop' into 'tool_calls', except for a
    named tool_choice; non-streaming auto mode does so even after 'length'."""
    if not (parses_tools and reply.tool_calls) or isinstance(tool_choice, dict):
        return engine_reason
    if engine_reason == "stop" or (not stream and tool_choice == "auto"):
        return "tool_calls"
    return engine_reason


def chat_response(
    ids: ResponseIds,
    message: dict[str, Any],
    finish_reason: str,
    stop_reason: str | None,
    usage: Usage,
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": stop_reason, "token_ids": None, "routed_experts": None}  # fmt: skip
    return _response(ids, "chat.completion", choice, usage, kv_transfer_params,
                     prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)  # fmt: skip


def completion_response(
    ids: ResponseIds,
    text: str,
    finish_reason: str,
    stop_reason: str | None,
    usage: Usage,
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason,
              "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}  # fmt: skip
    return _response(ids, "text_completion", choice, usage, kv_transfer_params)


def _response(
    ids: ResponseIds,
    kind: str,
    choice: dict[str, Any],
    usage: Usage,
    kv_transfer_params: dict[str, Any] | None,
    **extra: Any,
) -> dict[str, Any]:
    """A non-streaming body: every field present, nulls included, in vLLM's order."""
    return {
        "id": ids.id,
        "object": kind,
        "created": ids.created,
        "model": ids.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": ids.fingerprint,
        "usage": usage.body(),
        **extra,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def delta_chunk_sse(ids: ResponseIds, delta: dict[str, Any], usage: Usage | None = None) -> str:
    """``sse(chunk(...))`` for a plain mid-stream delta, the hot path, without
    re-encoding the parts every chunk shares; with ``usage``, the chunk as
    ``continuous_usage_stats`` sends it, its counts after the choices. (Built generically,
    that chunk cost 2.6x the plain one: the engine would spend more per token on a client
    that asks for the counts, as ampd's gateway does, than on one that does not.)"""
    if ids.chunk_head is None:
        ids.chunk_head = (
            f'data: {{"id":{json.dumps(ids.id)},"object":"{ids.chunk_object}","created":{ids.created},'
            f'"model":{json.dumps(ids.model)},"choices":[{{"index":0,"delta":'
        )
    counts = "" if usage is None else f',"usage":{usage.counts_json()}'
    return f"{ids.chunk_head}{json.dumps(delta, separators=(',', ':'))}{_CHOICE_TAIL}{counts}}}\n\n"


_CHOICE_TAIL = ',"logprobs":null,"finish_reason":null,"token_ids":null}]'


def chunk(ids: ResponseIds, choice: dict[str, Any] | None, **top: Any) -> dict[str, Any]:
    """One stream chunk; ``choice`` None gives the usage chunk's empty choices."""
    body: dict[str, Any] = {
        "id": ids.id,
        "object": ids.chunk_object,
        "created": ids.created,
        "model": ids.model,
        "choices": [] if choice is None else [choice],
    }
    body.update(top)
    return body


# -- streamed deltas ---------------------------------------------------------------


def chat_deltas(reply: Reply, parses_tools: bool) -> list[dict[str, Any] | None]:
    """The delta each generated token produces, as vLLM's hermes parser streams it.

    Text before ``<tool_call>`` streams as content; a call is announced (id, type,
    name; no arguments key) once its name's closing quote has been generated; then
    the raw argument text streams. Tokens that add nothing (the ``<tool_call>`` tag,
    JSON before the name closes, the tail after the arguments) yield ``None``: no chunk.
    """
    if not (parses_tools and reply.tool_calls):
        # Without a parser even an empty step (EOS) streams ``{"content": ""}``.
        return [{"content": p} if p or not parses_tools else None for p in reply.pieces]
    spans = _tool_call_spans(reply)
    deltas: list[dict[str, Any] | None] = []
    offset = 0
    for piece in reply.pieces:
        start, end = offset, offset + len(piece)
        offset = end
        calls: list[dict[str, Any]] = []
        for index, (call, name_end, args_start, args_end) in enumerate(spans):
            if start < name_end <= end:
                calls.append({"id": call.id, "type": "function", "index": index, "function": {"name": call.name}})
            fragment = reply.text[max(start, args_start) : min(end, args_end)]
            if fragment:
                calls.append({"index": index, "function": {"arguments": fragment}})
        if calls:
            deltas.append({"content": None, "tool_calls": calls})
        elif piece and end <= len(reply.content):
            deltas.append({"content": piece})
        else:
            deltas.append(None)
    return deltas


def _tool_call_spans(reply: Reply) -> list[tuple[Any, int, int, int]]:
    """For each call: (call, end of its name's closing quote, start and end of its arguments)."""
    spans = []
    text = reply.text
    cursor = len(reply.content)
    for call in reply.tool_calls:
        name_token = json.dumps(call.name)
        name_end = text.index(name_token, cursor) + len(name_token)
        args_start = text.index(call.arguments, name_end)
        args_end = args_start + len(call.arguments)
        spans.append((call, name_end, args_start, args_end))
        cursor = args_end
    return spans
