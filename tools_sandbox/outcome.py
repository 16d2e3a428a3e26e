"""What a tool call amounts to: the text the model reads, and whether it succeeded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    ok: bool
    content: str  # the tool message's content; errors say what went wrong, for the model to read
