"""`ampd up`: the whole local stack as child processes, stopped together on Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from ampd.local_redis import NoRedis, ensure_redis

STATE_DIR = Path(".ampd")  # logs, the private Redis's directory, and stack.json (what runs where)


@dataclass
class Child:
    name: str
    url: str
    process: subprocess.Popen


def start_sim_worker(role: str, port: int, profile: str, speed: float, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "ampd.cli",
        "worker",
        "sim",
        "--role",
        role,
        "--port",
        str(port),
        "--profile",
        profile,
        "--speed",
        str(speed),
    ]
    return subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def wait_healthy(children: list[Child], timeout_s: float = 60.0) -> Child | None:
    """None when all answer /health; else the first child that died or never answered."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        child = pending[0]
        if child.process.poll() is not None:
            return child
        try:
            if httpx.get(f"{child.url}/health", timeout=1.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return child
        time.sleep(0.2)
    return None


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_stack(console: Console, redis_url: str, prefill_port: int, decode_port: int, profile: str, speed: float) -> int:
    STATE_DIR.mkdir(exist_ok=True)
    try:
        redis = ensure_redis(redis_url, STATE_DIR / "redis")
    except NoRedis as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    children = [
        Child(
            f"{role} worker (GPU-free)",
            f"http://127.0.0.1:{port}",
            start_sim_worker(role, port, profile, speed, STATE_DIR / f"{role}.log"),
        )
        for role, port in (("prefill", prefill_port), ("decode", decode_port))
    ]
    try:
        failed = wait_healthy(children)
        if failed is not None:
            console.print(f"[red]{failed.name} did not come up; see {STATE_DIR}/*.log[/red]")
            return 1
        (STATE_DIR / "stack.json").write_text(
            json.dumps(
                {
                    "redis": redis.url,
                    "workers": [
                        {"role": role, "url": child.url}
                        for role, child in zip(("prefill", "decode"), children, strict=True)
                    ],
                },
                indent=2,
            )
        )
        table = Table("service", "address")
        table.add_row("redis", f"{redis.url} ({redis.source})")
        for child in children:
            table.add_row(child.name, child.url)
        console.print(table)
        console.print(
            f"Try: curl -N {children[1].url}/v1/chat/completions -H 'Content-Type: application/json' "
            '-d \'{"messages": [{"role": "user", "content": "Weather in Paris?"}], "stream": true, '
            '"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": '
            '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}\''
        )
        console.print("Ctrl-C stops everything.")
        signal.signal(signal.SIGTERM, _interrupt)
        while all(c.process.poll() is None for c in children):
            time.sleep(0.5)
        console.print("[red]a worker exited; stopping the stack[/red]")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for child in children:
            child.process.terminate()
        for child in children:
            try:
                child.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.process.kill()
        redis.stop()
