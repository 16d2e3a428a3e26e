"""Request migration: a round whose decode worker dies mid-stream goes on elsewhere.

When the connection to a session's decode worker breaks (the engine was killed, its
host went away), the gateway re-binds the session to another decode worker and asks
it to continue the assistant message from the text the client already has, with the
chat API's ``continue_final_message``: the new worker prefills the whole history plus
that text and writes on. The client sees one unbroken stream - the first leg's id, one
role delta, usage that covers both legs - and the session's later rounds run on the
new worker. The bar is Dynamo's request migration and its ``migration_limit``; Dynamo
resends token ids to its own engines, while ampd speaks the chat API, so a sampled
continuation sees the same text but not necessarily the same token ids (a greedy or
seeded one on the GPU-free engine continues exactly). A round that has begun a tool
call is not moved: half a call cannot be continued as text.

Pure functions and one chunk rewriter; the gateway (gateway.apis.app) does the I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.engines.upstream import Reply

Transform = Callable[[dict[str, Any]], dict[str, Any] | None]


def resumable(reply: Reply) -> bool:
    return not reply.tool_calls


def continuation_body(body: dict[str, Any], reply: Reply) -> dict[str, Any]:
    """The request for the new worker: prefill there (no KV to pull), and continue the
    text already streamed if there is any; otherwise the round starts over."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if not reply.content:
        return out
    out["messages"] = [*body["messages"], {"role": "assistant", "content": reply.content}]
    out.update(add_generation_prompt=False, continue_final_message=True)
    return out


def with_tokens_left(body: dict[str, Any], streamed_tokens: int) -> dict[str, Any]:
    """The length limits less what the first leg generated (at least one token is asked for,
    so a leg cut right after its last token still ends with a finish reason)."""
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if out.get(key) is not None:
            out[key] = max(1, out[key] - streamed_tokens)
    return out


def round_usage(continued: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """The round's usage from the continuation's: its prompt held the round's prompt and
    the text of the first leg, which the client counts as completion."""
    total = int(continued["prompt_tokens"]) + int(continued["completion_tokens"])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": total - prompt_tokens, "total_tokens": total}


@dataclass
class Continued:
    """Rewrites the continuation's chunks into the first leg's stream."""

    head: dict[str, Any]  # id, created, model of the first leg's first chunk
    prompt_tokens: int
    keep_usage: bool
    then: Transform | None = None  # the client view, when server tools run

    def __call__(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if chunk.get("usage") is not None and not chunk.get("choices"):
            if not self.keep_usage and self.then is None:
                return None
            chunk = dict(chunk, usage=round_usage(chunk["usage"], self.prompt_tokens))
        else:
            choices = [c for c in map(_without_role, chunk.get("choices") or []) if c is not None]
            if not choices:
                return None
            chunk = dict(chunk, choices=choices)
        chunk = dict(chunk, id=self.head.get("id"), created=self.head.get("created"))
        return self.then(chunk) if self.then is not None else chunk


def _without_role(choice: dict[str, Any]) -> dict[str, Any] | None:
    """The message was opened by the first leg; an empty delta is dropped."""
    delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
    if not delta.get("content") and not delta.get("tool_calls") and choice.get("finish_reason") is None:
        return None
    return dict(choice, delta=delta)
