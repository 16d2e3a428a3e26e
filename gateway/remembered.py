"""What a function gave for a JSON-shaped value, remembered by the value's digest.

Every round of a session resends its whole conversation, and the gateway works on each
message of it (its token count, its link in the session's hash chain). Remembering the
answer by a digest of the value as orjson writes it makes a round pay for its new
messages only. A digest (16 bytes) rather than the value is kept, so memory stays
bounded by the entry count; the table starts afresh when full. A value orjson cannot
write (an integer past 64 bits) is computed each time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import orjson

T = TypeVar("T")


class Remembered(Generic[T]):
    def __init__(self, compute: Callable[[Any], T], kept: int = 1 << 16) -> None:
        self.compute, self.kept, self.known = compute, kept, dict[bytes, T]()

    def __call__(self, value: Any) -> T:
        try:
            key = hashlib.blake2b(orjson.dumps(value), digest_size=16).digest()
        except orjson.JSONEncodeError:
            return self.compute(value)
        if key not in self.known:
            if len(self.known) >= self.kept:
                self.known.clear()
            self.known[key] = self.compute(value)
        return self.known[key]
