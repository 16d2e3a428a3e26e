"""What an rq tools worker runs for one tool call (in its forked work horse)."""

from __future__ import annotations

from tools_sandbox.registry import execute


def run_tool(name: str, arguments: str) -> dict[str, object]:
    outcome = execute(name, arguments)
    return {"ok": outcome.ok, "content": outcome.content}
