"""Who may call the gateway, and whose sessions a caller sees: the accepted API keys.

Keys come from the command line (``--api-key``, fixed for the process's life) and from a
file (``--api-keys-file``), which is re-read when it changes - a rotated Kubernetes Secret
mounted as that file applies without a restart. Each key names a scope: its tenant, or,
without one, the key itself (a digest). Sessions, conversation hashes and response ids are
namespaced by the scope, so one tenant never reads another's. With no key at all the
gateway is open: every caller shares the one public scope.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gateway.exchange import PUBLIC_SCOPE

log = logging.getLogger(__name__)
KEYS_POLL_S = 1.0  # how soon a changed keys file applies
TENANT = re.compile(r"tenant=([A-Za-z0-9_.-]{1,64})")


def key_digest(key: str) -> str:
    """A key as its SHA-256 hex digest: what the gateway keeps, so a file may hold digests only."""
    return key.removeprefix("sha256:") if key.startswith("sha256:") else hashlib.sha256(key.encode()).hexdigest()


def key_scope(digest: str, tenant: str | None) -> str:
    """The scope a key's requests run in: its tenant's (shared by the tenant's keys, so a
    rotated key keeps the sessions), else its own. The prefix keeps a tenant's name from
    ever equalling a digest's scope or the public one."""
    return f"t-{tenant}" if tenant else digest[:16]


def parse_keys(text: str, source: str) -> dict[str, str]:
    """A keys file's keys, digest to scope: one key a line, plain or ``sha256:<hex>``,
    optionally followed by ``tenant=NAME``; blank lines and ``#`` comments are skipped.
    Anything else is refused, naming ``source`` and the line, so a malformed file never
    half-applies (a space-separated list of keys, say, is not read as one key)."""
    keys = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        tenant = TENANT.fullmatch(words[1]) if len(words) == 2 else None
        if len(words) > 2 or (len(words) == 2 and tenant is None):
            raise ValueError(f"{source}:{number}: expected 'KEY [tenant=NAME]', got {len(words)} words")
        digest = key_digest(words[0])
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError(f"{source}:{number}: 'sha256:' must be followed by 64 lowercase hex digits")
        keys[digest] = key_scope(digest, tenant.group(1) if tenant else None)
    return keys


@dataclass(frozen=True)
class FileStamp:
    """What tells a keys file changed: a rewrite changes its time or size, a Secret's
    update swaps the file the path resolves to (another inode)."""

    mtime_ns: int
    size: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        stat = os.stat(path)
        return cls(stat.st_mtime_ns, stat.st_size, stat.st_ino)


class Keyring:
    """The keys accepted now: the fixed ones, plus the file's as last read."""

    def __init__(self, fixed: tuple[str, ...], file: Path | None) -> None:
        self.fixed = {key_digest(k): key_scope(key_digest(k), None) for k in fixed}
        self.file = file
        self.stamp: FileStamp | None = None
        self.scopes = dict(self.fixed)
        if file is not None:
            self.reload()

    @property
    def open(self) -> bool:
        """No key configured: every caller is let in, in the one public scope."""
        return not self.fixed and self.file is None

    def scope(self, key: str) -> str | None:
        """The scope of a key, None for one not accepted."""
        if self.open:
            return PUBLIC_SCOPE
        return self.scopes.get(hashlib.sha256(key.encode()).hexdigest()) if key else None

    def reload(self, force: bool = False) -> bool:
        """Re-read the file if it changed (or ``force``): True when its keys were taken.
        The first read's failure is raised - a gateway does not start on a bad keys file;
        a later one keeps the keys in force and says why, so a half-written or broken file
        never opens the gateway or locks every tenant out."""
        assert self.file is not None
        first = self.stamp is None
        try:
            stamp = FileStamp.of(self.file)
        except OSError:
            if first:
                raise
            stamp = FileStamp(0, 0, 0)  # gone: said once, until it is back
        if stamp == self.stamp and not force:
            return False
        self.stamp = stamp
        try:
            keys = parse_keys(self.file.read_text(), str(self.file))
        except (OSError, ValueError) as exc:
            if first:
                raise
            log.warning("keys file not reloaded, the keys in force stay: %s", exc)
            return False
        self.scopes = {**self.fixed, **keys}
        if not first:
            log.warning("keys file %s reloaded: %d keys", self.file, len(keys))
        return True

    async def watch(self, interval_s: float) -> None:
        """Re-read the file whenever it changes, by polling: a Secret's update reaches a
        mounted file as a swapped link, which no inotify watch on the path sees."""
        while True:
            await asyncio.sleep(interval_s)
            self.reload()
