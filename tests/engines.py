"""Engines under test as real processes, and readers for what they serve."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ampd.local_redis import free_port


@dataclass
class Engine:
    """An engine under test, reached only over HTTP (sim worker now, vLLM later)."""

    url: str
    model: str
    process: subprocess.Popen | None = None

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name plus sorted labels (model/engine dropped)."""
        out: dict[str, float] = {}
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
                key = sample.name + ("" if not labels else json.dumps(labels, sort_keys=True))
                out[key] = sample.value
        return out


def start_sim_worker(tmp: Path, *args: str, timeout_s: float = 30.0) -> Engine:
    port = free_port()
    log = (tmp / f"worker-{port}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "ampd.cli", "worker", "sim", "--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"worker exited: {(tmp / f'worker-{port}.log').read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("worker did not become healthy")
        time.sleep(0.1)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    return Engine(url, model, process)


def stop(engine: Engine) -> None:
    if engine.process is not None:
        engine.process.terminate()
        try:
            engine.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            engine.process.kill()


def sse_events(response: httpx.Response) -> list[dict | str]:
    """Parse a text/event-stream body into JSON payloads ('[DONE]' kept as a string)."""
    out: list[dict | str] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
