"""Tenancy said aloud and an access log an operator can use, on real gateways in
subprocesses in front of GPU-free engines and real Redis: open mode says so; keys from a
file scope sessions by tenant and are re-read while the gateway serves; every request
leaves one JSON line, errors included, without its content, in a file that rotates."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.tenancy import key_scope, parse_keys
from tests.engines import start_gateway, start_sim_worker, stop

REDIS_URL = "redis://127.0.0.1:6379/13"  # the suite's own database
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SECRET = "zebra-umbrella-7731"  # prompt text that must never reach the access log
ACCESS_FIELDS = {"time", "api", "session", "round", "route", "status", "ttft_s", "prompt_tokens", "completion_tokens"}


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """A prefill and a decode engine registered under a prefix of this module's own."""
    tmp = tmp_path_factory.mktemp("tenancy")
    prefix = f"tenancy-{uuid.uuid4().hex[:8]}"
    common = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "50")
    engines = [start_sim_worker(tmp, "--role", role, *common) for role in ("prefill", "decode")]
    yield tmp, prefix
    for engine in engines:
        stop(engine)
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def chat(url: str, key: str | None, session: str, text: str = "hello", **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 3,
            "prompt_cache_key": session, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def rounds_seen(url: str, key: str | None, session: str) -> int | None:
    """The session's round count as ``key`` sees it; None when it is not found (404)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{url}/v1/sessions/{session}", headers=headers, timeout=30)
    assert response.status_code in (200, 404), response.text
    return len(response.json()["rounds"]) if response.status_code == 200 else None


def replace_file(path: Path, text: str) -> None:
    """Rewrite ``path`` as a Secret's update does: a new file swapped in under the name."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)


@pytest.mark.unit
def test_keys_file_lines():
    digest = hashlib.sha256(b"sk-b").hexdigest()
    keys = parse_keys(f"# tenants\nsk-a tenant=acme\n\nsha256:{digest}  # hashed, no tenant\n", "keys")
    assert keys == {hashlib.sha256(b"sk-a").hexdigest(): "t-acme", digest: digest[:16]}
    assert key_scope(digest, "acme") == "t-acme" != key_scope(digest, None)
    for bad, why in (("sk-a sk-b", "keys:1: expected"), ("sk-a tenant=a b", "expected"), ("sha256:beef", "64")):
        with pytest.raises(ValueError, match=why):
            parse_keys(bad, "keys")


def test_open_mode_says_so(registry):
    tmp, prefix = registry
    gateway = start_gateway(tmp, REDIS_URL, prefix, "--access-log", "off")
    try:
        assert httpx.get(f"{gateway.url}/readyz").json()["tenancy"] == "open"
        output = tmp / f"gateway-{gateway.url.rsplit(':', 1)[1]}.log"
        wait_for(lambda: "sessions are not tenant-scoped" in output.read_text(), "the open-mode warning")
    finally:
        gateway.stop()


def test_keys_file_scopes_sessions_and_reloads(registry):
    tmp, prefix = registry
    keys = tmp / f"keys-{uuid.uuid4().hex[:6]}"
    keys.write_text("sk-alpha-1 tenant=alpha\nsk-beta-1 tenant=beta\n")
    gateway = start_gateway(tmp, REDIS_URL, prefix, "--api-keys-file", str(keys), "--access-log", "off")
    url, session = gateway.url, f"shared-{uuid.uuid4().hex[:6]}"
    try:
        assert httpx.get(f"{url}/readyz").json()["tenancy"] == "keys"
        # Two tenants naming the same prompt_cache_key get a session each, and neither sees the other's.
        assert chat(url, "sk-alpha-1", session).status_code == 200
        assert chat(url, "sk-alpha-1", session, "again").status_code == 200
        assert chat(url, "sk-beta-1", session).status_code == 200
        wait_for(lambda: rounds_seen(url, "sk-alpha-1", session) == 2, "alpha's two rounds recorded")
        assert rounds_seen(url, "sk-beta-1", session) == 1
        other = chat(url, None, session)  # no key is no caller at all
        assert other.status_code == 401 and other.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/sessions/{session}").status_code == 401

        # A new key for alpha (same tenant: its sessions stay), a key added, the old one gone.
        replace_file(keys, "sk-alpha-2 tenant=alpha\nsk-beta-1 tenant=beta\nsk-gamma-1 tenant=gamma\n")
        wait_for(lambda: chat(url, "sk-gamma-1", session).status_code == 200, "the added key accepted")
        assert chat(url, "sk-alpha-1", session).status_code == 401
        assert rounds_seen(url, "sk-alpha-2", session) == 2  # alpha's, not gamma's round of its own

        # A broken file is refused, loudly, and the keys in force stay.
        replace_file(keys, "sk-alpha-2 sk-beta-1\n")
        output = tmp / f"gateway-{url.rsplit(':', 1)[1]}.log"
        wait_for(lambda: "keys file not reloaded" in output.read_text(), "the broken file refused")
        assert chat(url, "sk-gamma-1", session).status_code == 200

        # SIGHUP re-reads a file even when nothing a poll looks at changed (same size, time, inode).
        stamp = keys.stat()
        replace_file(keys, "sk-delta-1 tenant=delta\n")
        keys.write_text("sk-delta-1 tenant=delta\n")
        os.utime(keys, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        gateway.process.send_signal(signal.SIGHUP)
        wait_for(lambda: chat(url, "sk-delta-1", session).status_code == 200, "SIGHUP applied the file")
        assert chat(url, "sk-gamma-1", session).status_code == 401
        assert gateway.process.poll() is None  # all of it without a restart
    finally:
        gateway.stop()


def test_access_log_lines_and_rotation(registry):
    tmp, prefix = registry
    access = tmp / f"access-{uuid.uuid4().hex[:6]}.log"
    options = ("--access-log", str(access), "--access-log-max-bytes", "4096", "--access-log-backups", "20")
    gateway = start_gateway(tmp, REDIS_URL, prefix, *options)
    url, session = gateway.url, f"logged-{uuid.uuid4().hex[:6]}"
    try:
        assert chat(url, None, session, SECRET).status_code == 200
        assert chat(url, None, session, SECRET, stream=True).status_code == 200
        responses = {"model": MODEL, "input": SECRET, "max_output_tokens": 3}
        assert httpx.post(f"{url}/v1/responses", json=responses, timeout=60).status_code == 200
        messages = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": SECRET}]}
        assert httpx.post(f"{url}/v1/messages", json=messages, timeout=60).status_code == 200
        bad = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": SECRET}, timeout=60)
        assert bad.status_code == 400
        sent = 5
        for _ in range(20):  # enough lines to pass the size limit a few times
            assert chat(url, None, session, SECRET).status_code == 200
        sent += 20

        def lines() -> list[dict]:
            """The API requests' lines, oldest first (start_gateway's /readyz probes left out)."""
            files = sorted(tmp.glob(f"{access.name}*"), key=lambda f: f.stat().st_mtime_ns)
            every = [json.loads(line) for f in files for line in f.read_text().splitlines()]
            return [line for line in every if line["path"] != "/readyz"]

        wait_for(lambda: len(lines()) >= sent, f"{sent} access lines")
        assert len(lines()) == sent  # one line a request
        rotated = [f for f in tmp.glob(f"{access.name}.*")]
        assert rotated and all(f.stat().st_size <= 4096 for f in rotated)
        assert all(SECRET not in f.read_text() for f in tmp.glob(f"{access.name}*"))
        first = lines()[:sent]
        ok = [line for line in first if line["status"] == 200]
        assert {line["api"] for line in ok} == {"chat", "responses", "messages"}
        assert all(set(line) >= ACCESS_FIELDS for line in first)
        for line in ok:
            assert line["ttft_s"] > 0 and line["completion_tokens"] > 0 and line["prompt_tokens"] > 0
            assert line["route"].split(":")[0] in ("local", "remote") and line["round"] >= 1
        chats = [line["round"] for line in ok if line["session"] == session]
        assert chats[0] == 1 and chats == sorted(chats) and chats[-1] > 1, chats
        error = next(line for line in first if line["status"] == 400)
        assert set(error) >= ACCESS_FIELDS and error["api"] == "chat" and error["session"] is None
    finally:
        gateway.stop()
