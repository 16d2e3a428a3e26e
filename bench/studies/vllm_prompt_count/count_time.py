"""What counting a vLLM engine's prompt costs a round: its ``/tokenize`` (what the gateway
asked before) against the gateway's own count (gateway.engines.model_tokenizer).

A one-off timing harness, not part of the package. One `ampd worker vllm` (the tiny Llama
on vLLM's CPU build, as tests/test_vllm.py starts it), then:

1. for agent conversations of 1, 10 and 30 tool rounds (a 2 KB system prompt, each tool
   result 600 characters), 30 times each with new text: the wall time of the engine
   client's ``tokenize`` call (and the CPU this process spent on it), and of
   ``ModelTokenizer.count`` for the round after the one it counted last (its new
   messages: a tool call and its result);
2. a gateway over the engine with its phases timed (overhead_hot_path/phase_breakdown.py),
   100 new one-round conversations streamed through it, one after another (its first
   rounds load the files, its first 32 counts are checked against the engine's); then the
   files' key deleted and the same with a new gateway, which asks the engine: the
   medians over the last 50 rounds of each of the count and of the time from the request
   reaching the gateway to its call to the engine.

    AMPD_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python bench/studies/vllm_prompt_count/count_time.py

Output of the run behind the overhead study: bench/results/overhead/hot_path/vllm_prompt_count.txt.
"""

import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ampd.local_redis import free_port  # noqa: E402
from ampd.processes import Child, wait_healthy  # noqa: E402
from gateway.engines.model_tokenizer import ModelTokenizer  # noqa: E402
from gateway.engines.upstream import EngineClient  # noqa: E402
from surface.registry import tokenizer_key  # noqa: E402
from tests.test_vllm import MODEL, REDIS_URL, running, start_vllm_worker  # noqa: E402
from workers.vllm import tiny_model  # noqa: E402

SYSTEM = "You are a careful agent: plan, call tools, read their results, answer in one sentence. " * 24
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def conversation(rng: random.Random, rounds: int, result_chars: int = 600) -> list[dict]:
    words = ["sunny", "cloudy", "24 C", "wind", "north", "rain", "later", "clear", "Oslo", "Rome"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in four cities?"}]
    for i in range(rounds):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": rng.choice(words)})}}  # fmt: skip
        result = " ".join(rng.choice(words) for _ in range(100))[:result_chars]
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": result}]  # fmt: skip
    return messages


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.2f} ms (p90 {statistics.quantiles(values, n=10)[-1] * 1e3:.2f})"


async def component(engine_url: str, files: dict, out: list[str]) -> None:
    client, rng = EngineClient(60.0), random.Random(1)
    for rounds in (1, 10, 30):
        tokenizer = ModelTokenizer(files)
        asked, asked_cpu, counted, tokens = [], [], [], 0
        for _ in range(30):
            messages = conversation(rng, rounds)
            tokenizer.count(messages[:-2], [WEATHER])  # the session's round before
            started = time.perf_counter()
            tokens = tokenizer.count(messages, [WEATHER])
            counted.append(time.perf_counter() - started)
            started, cpu = time.perf_counter(), time.process_time()
            engines = await client.tokenize(engine_url, MODEL, messages, [WEATHER])
            asked.append(time.perf_counter() - started)
            asked_cpu.append(time.process_time() - cpu)
            assert engines == tokens, (engines, tokens)
        out.append(f"{rounds:>2} tool rounds ({len(messages)} messages, {tokens} tokens): "
                   f"/tokenize {ms(asked)} (caller's CPU {ms(asked_cpu)}), gateway count {ms(counted)}")  # fmt: skip
    await client.close()


def phases(tmp: Path, prefix: str, name: str, rng: random.Random) -> list[str]:
    """A gateway with its phases timed (overhead_hot_path/phase_breakdown.py), 100 new
    one-round conversations through it: the medians it prints over the last 50."""
    port = free_port()
    log = tmp / f"{name}.log"
    harness = Path(__file__).resolve().parents[1] / "overhead_hot_path" / "phase_breakdown.py"
    with log.open("w") as out:
        command = [sys.executable, str(harness), "serve", REDIS_URL, prefix, str(port)]
        child = Child(name, f"http://127.0.0.1:{port}", subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
        try:
            assert wait_healthy([child], path="/readyz") is None, log.read_text()
            for _ in range(100):
                body = {"model": MODEL, "messages": conversation(rng, 1, 200), "tools": [WEATHER], "max_tokens": 4,
                        "stream": True}  # fmt: skip
                with httpx.stream("POST", f"{child.url}/v1/chat/completions", json=body, timeout=120) as response:
                    assert response.status_code == 200, response.read()
                    response.read()
            deadline = time.monotonic() + 10
            while "asgi -> client_first" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            child.stop()
    wanted = ("count_start -> count_done", "asgi -> post ", "asgi -> client_first")
    return [
        f"{name}: {' '.join(line.split())}" for line in log.read_text().splitlines() if line.strip().startswith(wanted)
    ]


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    model_dir = tiny_model.build(tmp / "model")
    prefix = f"count-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    out: list[str] = []
    with running(prefix, tmp, lambda: start_vllm_worker(tmp, model_dir, "decode", prefix)) as (engine,):
        files = json.loads(r.get(tokenizer_key(prefix, MODEL)))
        asyncio.run(component(engine.url, files, out))
        print("\n".join(out), flush=True)
        rng = random.Random(2)
        out += phases(tmp, prefix, "gateway counts", rng)  # its first rounds load the files, then checks
        r.delete(tokenizer_key(prefix, MODEL))
        out += phases(tmp, prefix, "engine counts", rng)
    print("\n".join(out))


if __name__ == "__main__":
    main()
