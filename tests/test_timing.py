"""Timing conformance: a sim worker's TTFT and ITL match its profile at any speed.

Measured at the client over HTTP, for single requests on an idle worker. The profile
(Llama-3.1-70B on two H20s) is slow enough that HTTP overhead stays well inside 5%.
"""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest

from perfmodel.profile import load_profile
from tests.engines import start_sim_worker, stop

PROFILE = "llama-3.1-70b_h20_tp2"
pytestmark = pytest.mark.timing  # 5% of a 1.5 ms gap: only on an otherwise idle machine


def measure(url: str, model: str, prompt: str, output_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, arrival times of every token) for one streamed chat completion."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    with httpx.Client(timeout=120) as client:
        warmup = {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}
        client.post(f"{url}/v1/chat/completions", json=warmup)  # first-call costs are not the model's
        start = time.perf_counter()
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    arrivals.append(time.perf_counter())
    return arrivals[0] - start, arrivals


@pytest.mark.parametrize(("speed", "prompt_words", "output_tokens"), [(1.0, 1500, 60), (20.0, 5000, 300)])
def test_ttft_and_itl_match_the_profile(tmp_path, speed, prompt_words, output_tokens):
    engine = start_sim_worker(tmp_path, "--profile", PROFILE, "--speed", str(speed))
    try:
        # Three prompts of one length that share no prefix (no cache hits); the best run
        # counts, since the machine's noise only ever adds to what the model says.
        prompts = [f"run{k} " + " ".join(f"w{i % 97}" for i in range(prompt_words)) for k in range(3)]
        counts = {httpx.post(f"{engine.url}/tokenize", json={"messages": [{"role": "user", "content": prompt}]})
                  .json()["count"] for prompt in prompts}  # fmt: skip
        (p,) = counts
        ttft, arrivals = min((measure(engine.url, engine.model, prompt, output_tokens) for prompt in prompts),
                             key=lambda run: run[0])  # fmt: skip
    finally:
        stop(engine)
    profile = load_profile(PROFILE)
    predicted_ttft = profile.t_pre(0, p) / speed
    predicted_itl = statistics.mean(profile.t_dec(1, p + k) for k in range(1, output_tokens)) / speed
    itl = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    assert len(arrivals) == output_tokens
    assert ttft == pytest.approx(predicted_ttft, rel=0.05)
    assert itl == pytest.approx(predicted_itl, rel=0.05)
