"""Real vLLM engines on the CPU: `ampd worker vllm`, the gateway over them, and the
engine protocol tests run against vLLM itself (vLLM's CPU build, which `make test` installs).

Two engines, registered as `both` and given the prefill and the decode role in Redis
(as an elastic pool's are), serve a tiny Llama with random weights
(workers.vllm.tiny_model), hand KV over with NIXL (UCX over TCP), and live only while
this module runs: NIXL's UCX progress thread busy-polls a core per engine, and would
slow every other test on a two-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from ampd.local_redis import free_port
from ampd.processes import spawn
from gateway.engines.kv_index import KVIndex, cached_tokens, request_hashes
from gateway.engines.kv_subscriber import KVSubscriber
from gateway.engines.model_tokenizer import ModelTokenizer
from gateway.metrics import Family
from perfmodel.profile import DEFAULT_PROFILE, load_profile
from perfmodel.step_correction import MAX_FACTOR
from rounds.engine.step_budget import MIN_PREFILL_TOKENS, step_token_budget
from surface.kv_events import BlockHasher
from surface.registry import WorkerInfo, live_workers, tokenizer_key
from tests import conversations
from tests import test_engine_protocol as protocol
from tests import test_kv_events as kv
from tests.engines import METRICS_TIMEOUT_S, Engine, start_gateway, start_sim_worker, stop

REDIS_URL = "redis://127.0.0.1:6379/13"
ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("AMPD_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
MODEL = "tiny-llama"
# Each engine's OMP thread is left unpinned so the kernel can move it off the core
# where the other engine's NIXL progress thread spins; the engines run at a lower
# priority (niceness 10) so the spinning leaves the gateways, Redis and the test their turn.
# Their supervisors do not: niced with them, beside other tests, they missed heartbeats
# (2.5 s Redis timeouts) and their engines dropped out of the registry for a moment.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "AMPD_VLLM_PYTHON": VLLM_PYTHON}
# No torch.compile (vLLM's -O0): vLLM's CPU build compiles its model with Inductor at start-up,
# most of an engine's start (one engine on an idle core served after 84 s, 34 s with -O0), and
# the chain of vLLM modules is the suite's longest path. What the tests check - scheduling,
# paged KV, hand-offs, the wire - is the same run eager.
QUICK_START = ("-O0",)
VLLM_ARGS = (
    "--load-format",
    "dummy",
    "--max-model-len",
    "2048",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--trust-request-chat-template",  # tests/test_vllm.py counts prompts under a template of its own
    *QUICK_START,
)
# Engines niced to 10 get a tenth of a core's share beside a busy neighbour: two of them
# took 310 s to serve on an otherwise idle CI machine and more than 480 s beside a process
# busy on one core. The limit stays under the module's (below), so a hang still fails here.
READY_TIMEOUT_S = 840.0

# A module's first test also pays for starting its engines (its fixture's setup): two vLLM
# engines took 107 s to start and 86 s more to serve tests/test_vllm_handoffs.py's eight
# requests on an idle two-core machine, and past the suite's 300 s limit on a busier one.
# Every module that starts vLLM engines takes this limit.
VLLM_TIMEOUT = pytest.mark.timeout(900)  # and the module is named test_vllm* (tests/conftest.py)
pytestmark = VLLM_TIMEOUT


# A drain waits for the engine's every request; one an earlier test left behind (seen once in
# CI under load: the decode worker still draining 120 s after SIGTERM) must not hold a test that
# stops an engine past its wait. The worker logs what a slow drain waits on.
DRAIN_TIMEOUT_S = 45.0
LOG_TAIL_LINES = 40
_logs: list[Path] = []  # the running engines' logs, for failure_context
STEP_LOGS: dict[str, Path] = {}  # the decode engine's step log, by registry prefix


def failure_context() -> str:
    """The last lines of each engine's log and its last errors (tests/conftest.py adds
    this to a failing test's report)."""
    parts = []
    for log in _logs:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        errors = [line for line in lines if " ERROR " in line or "Traceback" in line][-10:]
        tail = lines[-LOG_TAIL_LINES:]
        parts.append(f"== {log.name}: last errors ==\n" + "\n".join(e[:300] for e in errors))
        parts.append(f"== {log.name}: last {len(tail)} lines ==\n" + "\n".join(t[:300] for t in tail))
    return "\n".join(parts)


def start_vllm_worker(
    tmp: Path, model_dir: Path, name: str, prefix: str, *options: str, vllm_args: tuple[str, ...] = VLLM_ARGS
) -> Engine:
    """An engine registered as `both`: its role is what Redis says (``set_roles``).
    ``options`` go to `ampd worker vllm` (``--tp 2``), ``vllm_args`` to vLLM."""
    port = free_port()
    command = [
        "worker", "vllm", "--model", str(model_dir), "--served-model-name", MODEL, "--role", "both", *options,
        "--host", "127.0.0.1", "--port", str(port), "--side-channel-port", str(free_port()),
        "--kv-buffer-device", "cpu", "--redis-url", REDIS_URL, "--redis-prefix", prefix,
        "--ready-timeout", str(READY_TIMEOUT_S), "--drain-timeout", str(DRAIN_TIMEOUT_S), "--engine-niceness", "10",
        "--", *vllm_args,
    ]  # fmt: skip
    log = tmp / f"vllm-{name}.log"
    _logs.append(log)
    child = spawn(f"vllm {name}", port, command, log=log, env=VLLM_ENV)
    return Engine(child.url, MODEL, child, kind="vllm")


@contextlib.contextmanager
def running(prefix: str, tmp: Path, *starts: Callable[[], Engine]) -> Iterator[list[Engine]]:
    """Engines started one after the other and waited for until registered; on the way out
    stopped, and the registry prefix's keys removed."""
    started: list[Engine] = []
    try:
        for start in starts:
            started.append(start())
        wait_registered(started, prefix, tmp)
        yield started
    finally:
        for engine in started:
            engine.child.stop(timeout_s=60)
        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)


def registered(prefix: str) -> dict[str, WorkerInfo]:
    """The live registry entries, by URL."""

    async def read() -> list[WorkerInfo]:
        async with aioredis.from_url(REDIS_URL, decode_responses=True) as r:
            return await live_workers(r, prefix)

    return {info.url: info for info in asyncio.run(read())}


def wait_registered(engines: list[Engine], prefix: str, tmp: Path) -> None:
    """Registration is the supervisor's readiness: it registers once vLLM serves."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        urls = registered(prefix)
        if all(e.url in urls for e in engines):
            return
        for e in engines:
            assert e.child.process.poll() is None, "\n".join(
                (tmp / f).read_text()[-3000:] for f in os.listdir(tmp) if f.endswith(".log")
            )
        time.sleep(1)
    raise AssertionError(f"vLLM workers did not register within {READY_TIMEOUT_S} s")


def worker_ids(prefix: str, engines: list[Engine], timeout_s: float = 120) -> dict[str, str]:
    """The engines' worker ids by URL, from one read of the registry that lists them all:
    an engine whose supervisor missed a heartbeat (see :func:`set_roles`) is waited for."""
    deadline = time.monotonic() + timeout_s
    while not all(e.url in (live := registered(prefix)) for e in engines):
        assert time.monotonic() < deadline, f"{[e.url for e in engines]} not all registered within {timeout_s} s"
        time.sleep(0.5)
    return {e.url: live[e.url].worker_id for e in engines}


def set_roles(prefix: str, roles: dict[str, str], timeout_s: float = 120) -> None:
    """Each engine's role (by worker id), as an operator gives it (`ampd workers set`, which
    refuses an engine that is not registered). A supervisor niced beside engines that
    busy-poll every core can miss a heartbeat and drop out of the registry for a moment
    (seen in CI); such an engine is waited for until it registers again."""
    deadline, pending = time.monotonic() + timeout_s, dict(roles)
    while pending:
        for worker_id, role in list(pending.items()):
            command = [sys.executable, "-m", "ampd.cli", "workers", "set", worker_id, role,
                       "--redis-url", REDIS_URL, "--redis-prefix", prefix]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
            if done.returncode == 0:
                del pending[worker_id]
            else:
                assert "no engine" in done.stdout + done.stderr, done.stdout + done.stderr
                assert time.monotonic() < deadline, f"{worker_id} did not register again in {timeout_s} s"
                time.sleep(1)


PULLS, FIRSTS = "vllm:nixl_xfer_time_seconds_count", "vllm:time_to_first_token_seconds_count"


@contextlib.contextmanager
def weighted_pair(tmp: Path, prefix: str, names: tuple[str, str], vllm_args: tuple[str, ...]) -> Iterator[list[Engine]]:
    """Two `kv_both` engines of the tiny Llama with its own seeded weights (a greedy answer
    depends on every token it attends to), registered, their first hand-off made."""
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"vLLM's CPU build is not installed at {VLLM_PYTHON} (`make test` installs it)")
    model_dir = tmp / "model"
    subprocess.run([VLLM_PYTHON, "-m", "workers.vllm.tiny_model", str(model_dir), "--weights"], cwd=ROOT, check=True)
    start = [lambda name=name: start_vllm_worker(tmp, model_dir, name, prefix, vllm_args=vllm_args) for name in names]
    with running(prefix, tmp, *start) as engines:
        first_handoff(*engines)
        yield engines


def first_handoff(prefill: Engine, decode: Engine, attempts: int = 6) -> None:
    """One hand-off whose KV came over NIXL, so that the decode engine's handshake with the
    prefill engine is made before the tests count transfers. vLLM makes it lazily on the
    first pull and waits for the prefill engine's side channel for a hard-coded 5 s (ZMQ
    RCVTIMEO in its NIXL worker); engines busy-polling every core can miss that - seen in
    CI, most with a TP 2 engine's two ranks - and the pull then fails into a recompute
    (200, no transfer). A later pull retries the handshake, so each attempt checks that a
    transfer was counted."""
    for _ in range(attempts):
        before = decode.metrics()[PULLS]
        first = protocol.chat(prefill, messages=protocol.USER, max_tokens=1, kv_transfer_params=protocol.NIXL_PARAMS)
        params = first.json()["kv_transfer_params"]
        protocol.chat(decode, messages=protocol.USER, max_tokens=1, kv_transfer_params=params)
        if decode.metrics_once(lambda m, before=before: m[PULLS] > before, timeout_s=10)[PULLS] > before:
            return
    raise AssertionError(f"no NIXL transfer in {attempts} hand-offs\n{failure_context()}")


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> Iterator[tuple[Engine, Engine, str]]:
    """(prefill, decode, registry prefix): two `ampd worker vllm` supervisors, registered,
    in those roles."""
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"vLLM's CPU build is not installed at {VLLM_PYTHON} (`make test` installs it)")
    tmp = tmp_path_factory.mktemp("vllm")
    model_dir = tmp / "model"
    subprocess.run([VLLM_PYTHON, "-m", "workers.vllm.tiny_model", str(model_dir)], cwd=ROOT, check=True)
    prefix = f"vllm-{uuid.uuid4().hex[:8]}"
    prefill = start_vllm_worker(tmp, model_dir, "prefill", prefix)
    # The decode engine runs ampd's scheduler (workers.vllm.step_sizing), its target off until
    # the step-sizing test sets one: every other test checks that it then schedules as vLLM does.
    STEP_LOGS[prefix] = tmp / "steps.jsonl"
    decode = start_vllm_worker(tmp, model_dir, "decode", prefix, "--step-target-ms", "0",
                               "--step-log", str(STEP_LOGS[prefix]))  # fmt: skip
    try:
        wait_registered([prefill, decode], prefix, tmp)
        ids = {u: info.worker_id for u, info in registered(prefix).items()}
        set_roles(prefix, {ids[prefill.url]: "prefill", ids[decode.url]: "decode"})
        first_handoff(prefill, decode)
        yield prefill, decode, prefix
    finally:
        for engine in (prefill, decode):
            engine.child.stop(timeout_s=60)
        _logs.clear()
        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)


@pytest.fixture(scope="module")
def pd_pair(vllm) -> tuple[Engine, Engine]:
    return vllm[0], vllm[1]


@pytest.fixture(scope="module")
def engine(vllm) -> Engine:
    return vllm[1]


# The engine protocol tests, now against vLLM itself.
test_models_and_health = protocol.test_models_and_health
test_chat_non_stream_shape = protocol.test_chat_non_stream_shape
test_chat_stream_chunks = protocol.test_chat_stream_chunks
test_tokenize_agrees_with_usage = protocol.test_tokenize_agrees_with_usage
test_tool_call_streams_as_deltas = protocol.test_tool_call_streams_as_deltas
test_openai_sdk_runs_a_multi_round_tool_session = protocol.test_openai_sdk_runs_a_multi_round_tool_session
test_completions_stream_and_non_stream = protocol.test_completions_stream_and_non_stream
test_metrics_use_vllm_names = protocol.test_metrics_use_vllm_names
test_a_cache_salt_keeps_prefix_blocks_apart = protocol.test_a_cache_salt_keeps_prefix_blocks_apart
test_errors_have_openai_shape = protocol.test_errors_have_openai_shape
test_prompt_length_is_checked_in_chars_then_tokens = protocol.test_prompt_length_is_checked_in_chars_then_tokens
test_any_role_the_template_renders_is_accepted = protocol.test_any_role_the_template_renders_is_accepted
test_a_final_assistant_message_is_continued = protocol.test_a_final_assistant_message_is_continued
test_content_parts_are_read_as_vllm_reads_them = protocol.test_content_parts_are_read_as_vllm_reads_them
test_malformed_json_is_a_400 = protocol.test_malformed_json_is_a_400
test_client_disconnect_aborts_and_frees_kv = protocol.test_client_disconnect_aborts_and_frees_kv
test_prefill_returns_nixl_transfer_params = protocol.test_prefill_returns_nixl_transfer_params
test_a_prefill_allowed_more_tokens_holds_the_kv_of_its_output_too = (
    protocol.test_a_prefill_allowed_more_tokens_holds_the_kv_of_its_output_too
)
test_handoff_round_two_pulls_only_missing_blocks = protocol.test_handoff_round_two_pulls_only_missing_blocks
test_stale_transfer_params_leave_the_decoder_healthy = protocol.test_stale_transfer_params_leave_the_decoder_healthy


def test_the_engine_runs_niced_below_its_supervisor(vllm):
    """`--engine-niceness 10`: once it serves, vLLM (the supervisor's child) is niced, every
    thread of every process it started (its engine core and workers, whose NIXL threads
    busy-poll), and the scheduling group of its session; its supervisor, whose heartbeats
    keep the engine registered, is not."""
    decode = vllm[1]
    supervisor = decode.child.process.pid
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == supervisor]
    assert len(children) == 1 and os.getpriority(os.PRIO_PROCESS, supervisor) == 0
    processes, level = set(children), set(children)
    while level := {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) in level}:
        processes |= level
    threads = [int(t) for pid in processes for t in os.listdir(f"/proc/{pid}/task")]
    assert len(processes) >= 3 and len(threads) > len(processes)  # the server, its engine core and worker
    assert {_niceness(tid) for tid in threads} - {None} == {10}
    autogroup = Path(f"/proc/{children[0]}/autogroup")
    if autogroup.exists():  # its own session's scheduling group, niced too (supervisor._engine_started)
        assert autogroup.read_text().split()[-1] == "10"


def _niceness(tid: int) -> int | None:
    """A thread's niceness; None if it ended since it was listed."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None


def _parent(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


# -- the gateway over vLLM ---------------------------------------------------------------

WEATHER = protocol.WEATHER
SYSTEM = "You are a careful agent: plan, call tools, read their results, answer in one sentence. " * 6


@pytest.fixture(scope="module")
def gateways(vllm, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(disagg, coloc) gateway URLs over the same registry: a session alternating between
    them has its rounds prefilled remotely and locally, deterministically."""
    _, _, prefix = vllm
    tmp = tmp_path_factory.mktemp("vllm-gateways")
    children = [start_gateway(tmp, REDIS_URL, prefix, "--policy", policy) for policy in ("disagg", "coloc")]
    _logs.extend(sorted(tmp.glob("gateway-*.log")))  # what each gateway saw of the engines, for failure_context
    yield children[0].url, children[1].url
    for child in children:
        child.stop()


def round_recorded(before: dict[str, float], pulled: bool) -> Callable[[dict[str, float]], bool]:
    """A round's stats are in: its first token, and a remote round's KV pull."""
    return lambda m: m[FIRSTS] > before[FIRSTS] and (not pulled or m[PULLS] > before[PULLS])


def test_a_tool_session_through_the_gateway_hands_kv_over_with_nixl(vllm, gateways):
    """Four client-side tool rounds: remote (NIXL), local, remote, local. vLLM's own
    /metrics must show one NIXL transfer per remote round, and the decode engine's
    prefix cache hitting the session's history on every later round."""
    _, decode, _ = vllm
    session_id = f"vllm-{uuid.uuid4().hex[:8]}"
    headers = {"X-Session-Id": session_id}
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris and Rome?"}]
    force = {"type": "function", "function": {"name": "get_weather"}}
    hits, transfers, prompts = [], [], []
    for k in range(4):
        before = decode.metrics()
        client = openai.OpenAI(base_url=f"{gateways[k % 2]}/v1", api_key="unused", max_retries=0)
        last = k == 3
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none" if last else force,
            max_tokens=8 if last else 64, seed=k, extra_headers=headers,
        )  # fmt: skip
        reply = raw.parse()
        expected = "remote" if k % 2 == 0 else "local"
        assert raw.headers["x-ampd-route"].split(":", 1)[0] == expected
        after = decode.metrics_once(round_recorded(before, pulled=expected == "remote"))
        transfers.append(after[PULLS] - before[PULLS])
        hits.append(after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"])
        prompts.append(reply.usage.prompt_tokens)
        message = reply.choices[0].message
        if last:
            break
        assert message.tool_calls, f"round {k + 1}: the forced tool call is missing"
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny, 24 C. " * 8})
    assert transfers == [1, 0, 1, 0]
    block = decode.block_size
    # Every later round hits at least the full blocks of the round before it (its history).
    assert all(hits[k] >= prompts[k - 1] // block * block for k in range(1, 4)), (hits, prompts)
    body = httpx.get(f"{gateways[0]}/v1/sessions/{session_id}").json()
    assert [(r["kind"], r["route"]) for r in body["rounds"]] == [
        ("initial", "remote"), ("incremental", "local"), ("incremental", "remote"), ("incremental", "local"),
    ]  # fmt: skip
    assert all(r["ttft_s"] > 0 for r in body["rounds"])


def test_the_gateway_counts_prompts_as_vllm_does(vllm, gateways):
    """With the tokenizer files the supervisor published, the gateway's count
    (gateway.engines.model_tokenizer) is vLLM's own ``/tokenize`` count for random agent
    conversations (tests/conversations.py) - under the model's template, which loops over
    content parts, and under two that read content as a string (given in the request) -
    and the gateway over vLLM counts its prompts itself: every count it checked against
    the engine's agreed."""
    _, decode, prefix = vllm
    published = json.loads(redis.Redis.from_url(REDIS_URL).get(tokenizer_key(prefix, MODEL)))
    rng = random.Random(11)
    for template in (None, conversations.STRING_TEMPLATE, conversations.AGENT_TEMPLATE):
        tokenizer = ModelTokenizer(published | {"chat_template": template})
        for _ in range(100):
            messages, tools = conversations.conversation(rng)
            body = {"model": MODEL, "messages": messages} | ({"tools": tools} if tools else {})
            body |= {"chat_template": template} if template else {}
            response = httpx.post(f"{decode.url}/tokenize", json=body, timeout=60)
            assert tokenizer.count(messages, tools) == response.json()["count"], body
    session_id = f"count-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Oslo?"}]
    for _ in range(3):  # the first round loads the files; the next ones are counted in the gateway
        reply = chat(gateways[1], session_id, messages).json()["choices"][0]["message"]
        messages += [{"role": "assistant", "content": reply["content"] or ""}, {"role": "user", "content": "And now?"}]

    def checked() -> bool:
        text = httpx.get(f"{gateways[1]}/metrics", timeout=METRICS_TIMEOUT_S).text
        assert 'ampd_prompt_count_checks_total{result="differs"} 0.0' in text
        return 'ampd_prompt_count_checks_total{result="equal"} 0.0' not in text

    until(checked, 60, "the gateway's counts checked against the engine's")


def test_a_failed_kv_pull_is_recomputed_on_the_decode_engine(vllm):
    """The prefill engine's side channel is unreachable (its port is dead): the decode
    engine's NIXL handshake fails, and with kv_load_failure_policy "recompute" it prefills
    the prompt itself and answers, rather than failing the round with a 500."""
    prefill, decode, _ = vllm
    messages = [{"role": "user", "content": f"Recompute me {uuid.uuid4().hex}."}]
    first = protocol.chat(prefill, messages=messages, max_tokens=1, kv_transfer_params=protocol.NIXL_PARAMS)
    assert first.status_code == 200, first.text
    params = dict(first.json()["kv_transfer_params"], remote_port=free_port(), remote_engine_id=uuid.uuid4().hex)
    before = decode.metrics()["vllm:nixl_xfer_time_seconds_count"]
    second = protocol.chat(decode, messages=messages, kv_transfer_params=params, max_tokens=4)
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["completion_tokens"] == 4
    assert decode.metrics()["vllm:nixl_xfer_time_seconds_count"] == before  # nothing came over NIXL


def roles_applied(url: str, roles: dict[str, str]) -> Callable[[], bool]:
    """Whether the gateway at ``url`` shows each worker (by id) in its role."""
    lines = [f'ampd_worker_role{{role="{role}",worker="{worker_id}"}} 1.0' for worker_id, role in roles.items()]
    return lambda: all(line in httpx.get(f"{url}/metrics", timeout=METRICS_TIMEOUT_S).text for line in lines)


def until(condition: Callable[[], bool], timeout_s: float, what: str, seen: Callable[[], str] | None = None) -> None:
    """Wait for ``condition``; at the deadline fail saying what ``seen`` shows then."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}" + (f"; saw {seen()}" if seen else "")
        time.sleep(0.2)


def listed_roles(url: str) -> Callable[[], str]:
    """The engine roles the gateway at ``url`` lists now, for a failed wait to report."""

    def seen() -> str:
        lines = [line for line in httpx.get(f"{url}/metrics", timeout=METRICS_TIMEOUT_S).text.splitlines()
                 if line.startswith("ampd_worker_role")]  # fmt: skip
        return f"{lines} at {time.strftime('%H:%M:%S')}"

    return seen


def chat(gateway: str, session_id: str, messages: list[dict]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "seed": 1}
    response = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers={"X-Session-Id": session_id},
                          timeout=300)  # fmt: skip
    assert response.status_code == 200, response.text
    return response


def test_engines_swap_roles_under_a_session_and_back_and_its_kv_follows(vllm, gateways):
    """Elastic moves on real vLLM, with no restart: the engines swap roles while a round of
    a session streams on the decode engine - the round finishes there - and swap back
    before its third round. Each next round binds to the engine decoding at the time and
    is prefilled on the one that holds the session's history, from where the decode
    engine pulls the KV over NIXL instead of recomputing it."""
    prefill, decode, prefix = vllm
    gateway = gateways[0]  # disagg: every round is a hand-off
    ids = worker_ids(prefix, [prefill, decode])  # seen in a clean-clone run: one of them out for a moment
    first_handoff(decode, prefill)  # the new direction's NIXL handshake (see first_handoff)
    session_id = f"swap-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan the week."}]
    swapped = {ids[prefill.url]: "decode", ids[decode.url]: "prefill"}
    restored = {ids[prefill.url]: "prefill", ids[decode.url]: "decode"}
    # An engine whose scrape stalls past the gateway's grace is out of its pool until its
    # next good scrape - likely what gave this test's first round a 503 in a clean-clone
    # run, right after the test before stalled the decode engine in a failed handshake.
    until(
        roles_applied(gateway, restored), 60, "the gateway to list both engines in their roles", listed_roles(gateway)
    )
    body = {"model": MODEL, "messages": messages, "max_tokens": 48, "ignore_eos": True, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers={"X-Session-Id": session_id},
                          timeout=300) as stream:  # fmt: skip
            assert stream.status_code == 200 and stream.headers["x-ampd-decode-worker"] == ids[decode.url]
            events = (line[6:] for line in stream.iter_lines() if line.startswith("data: "))
            seen = [next(events)]  # the round is streaming
            set_roles(prefix, swapped)
            seen += list(events)
        assert seen[-1] == "[DONE]"
        chunks = [json.loads(e) for e in seen[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 48  # the round finished on its engine
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        until(roles_applied(gateway, swapped), 120, "the gateway to apply the swapped roles", listed_roles(gateway))

        for k, (decoding, holder) in enumerate([(prefill, decode), (decode, prefill)]):
            if k == 1:  # and back
                set_roles(prefix, restored)
                until(roles_applied(gateway, restored), 120, "the gateway to apply the roles again")
            before = decoding.metrics()
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then ({k})?"}]
            reply = chat(gateway, session_id, messages)
            assert reply.headers["x-ampd-decode-worker"] == ids[decoding.url]
            assert reply.headers["x-ampd-route"] == f"remote:{ids[holder.url]}"
            after = decoding.metrics_once(round_recorded(before, pulled=True))
            assert after[PULLS] - before[PULLS] == 1  # the history came over, not recomputed
            text = reply.json()["choices"][0]["message"]["content"]
        rounds = httpx.get(f"{gateway}/v1/sessions/{session_id}").json()["rounds"]
        assert [r["prefill_worker"] for r in rounds] == [ids[prefill.url], ids[decode.url], ids[prefill.url]]
    finally:
        set_roles(prefix, restored)
        for url in gateways:
            until(roles_applied(url, restored), 120, "the gateways to apply the roles again")


def test_the_installed_vllm_has_what_ampds_scheduler_overrides():
    """The guard for a vLLM upgrade: the scheduler's seams are all there, with a clear message if not."""
    done = subprocess.run([VLLM_PYTHON, "-m", "workers.vllm.step_sizing"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_steps_keep_to_the_target_while_streams_decode_and_answers_do_not_change(vllm):
    """ampd's scheduler in the decode engine: streams decode while a long prompt arrives, first
    with the target off (vLLM's budget: the prompt in one chunk), then with a target set in the
    registry, as `ampd workers step-target` does, without a restart. Each step that carried
    the prompt beside the decodes keeps to the target as the engine's profile prices it,
    corrected by the steps it timed (or takes the floor), and the prompt's greedy answer is
    the same token for token."""
    _, decode, prefix = vllm
    steps, log = STEP_LOGS[prefix], STEP_LOGS[prefix].with_name("vllm-decode.log")
    profile = load_profile(DEFAULT_PROFILE)
    first = beside_decodes(decode, steps, "untargeted")
    untargeted = [json.loads(line) for line in _lines(steps)]
    assert all(s["target_s"] == 0 and s["budget"] == s["full"] for s in untargeted)
    assert max(s["prefill_tokens"] for s in untargeted) >= first.prompt_tokens  # the prompt in one chunk
    full = untargeted[-1]["full"]  # vLLM's budget on its CPU build

    target_s = profile.step_time([(0, 256)], [STREAM_CONTEXT] * STREAMS)  # about 256 prefill tokens a step
    set_step_target(prefix, registered(prefix)[decode.url].worker_id, target_s * 1e3, log)
    try:
        second = beside_decodes(decode, steps, "targeted")
    finally:
        set_step_target(prefix, registered(prefix)[decode.url].worker_id, 0.0, log)
    assert second.text == first.text and second.prompt_tokens == first.prompt_tokens  # greedy: the same tokens
    targeted = [s for s in map(json.loads, _lines(steps)[len(untargeted) :]) if s["target_s"] > 0]
    assert targeted and all(s["scheduled"] <= s["budget"] <= s["full"] for s in targeted)
    carried = [s for s in targeted if s["prefill_tokens"] > 0 and s["decodes"] == STREAMS]
    assert len(carried) >= 2 and all(s["prefill_tokens"] < second.prompt_tokens for s in carried), carried
    for s in carried:  # the step's own price, corrected, within the target, unless it took the floor
        corrected = s["predicted_s"] * s["factor"]
        assert corrected <= s["target_s"] * (1 + 1e-6) or s["prefill_tokens"] <= MIN_PREFILL_TOKENS, s
        decoding = [STREAM_CONTEXT] * s["decodes"]  # contexts only grow, and a larger one leaves less room
        assert s["budget"] <= step_token_budget(profile, s["target_s"] / s["factor"], decoding, 0, full) < full, s
    # Every step was timed, and the prices were corrected from what the steps took: the profile
    # is an H100's, nothing like this CPU's.
    assert all(s["measured_s"] > 0 for s in untargeted + targeted)
    assert carried[-1]["factor"] != 1.0
    # The supervisor publishes the correction in the registry, where gateways price prefills with it.
    deadline = time.monotonic() + 30
    while (published := registered(prefix)[decode.url].prefill_factor) == 1.0:
        assert time.monotonic() < deadline, "the scheduler's correction never reached the registry"
        time.sleep(0.5)
    assert 1 / MAX_FACTOR <= published <= MAX_FACTOR


STREAMS, STREAM_CONTEXT = 4, 40


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int


def beside_decodes(engine: Engine, steps: Path, salt: str) -> Answer:
    """A long prompt's greedy answer, sent once four streams decode (the step log shows them).
    The streams ask for more tokens than the prompt can take time (so all four overlap however
    slowly a loaded machine lets them start) and hang up once it is answered. Each pass has a
    cache salt of its own: the prompt is computed, not found in the prefix cache."""
    seen = len(_lines(steps))
    answered = threading.Event()
    rng = random.Random(7)
    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(1500))

    def complete(text: str, max_tokens: int, stream: bool) -> Answer:
        body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_salt": salt, "stream": stream}  # fmt: skip
        if not stream:
            response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=600)
            assert response.status_code == 200, response.text
            reply = response.json()
            return Answer(reply["choices"][0]["text"], reply["usage"]["prompt_tokens"])
        chunks = []
        with httpx.stream("POST", f"{engine.url}/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                if answered.is_set():
                    break  # hangs up: vLLM aborts the rest
        return Answer("".join(c["choices"][0]["text"] for c in chunks if c["choices"]), 0)

    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(complete, "abcd" * (STREAM_CONTEXT // 4), 1500, True) for _ in range(STREAMS)]
        deadline = time.monotonic() + 300
        while not any(json.loads(line)["decodes"] == STREAMS for line in _lines(steps)[seen:]):
            assert time.monotonic() < deadline, "the streams never decoded together"
            assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()]
            time.sleep(0.2)
        try:
            answer = complete(prompt, 8, False)
        finally:
            answered.set()
        assert all(s.result().text for s in streams)
    return answer


def _lines(steps: Path) -> list[str]:
    return steps.read_text().splitlines() if steps.exists() else []


def set_step_target(prefix: str, worker_id: str, target_ms: float, log: Path) -> None:
    """`ampd workers step-target`, then until the engine's supervisor says it handed it on."""
    said = f"step target {target_ms:.1f} ms"
    before = log.read_text().count(said)
    command = [sys.executable, "-m", "ampd.cli", "workers", "step-target", worker_id, f"{target_ms:.3f}",
               "--redis-url", REDIS_URL, "--redis-prefix", prefix]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 60
    while log.read_text().count(said) == before:
        assert time.monotonic() < deadline, f"the engine never took the target {target_ms:.1f} ms"
        time.sleep(0.2)


def test_vllm_publishes_kv_events_whose_hashes_ampd_and_the_gpu_free_engine_compute(vllm, tmp_path):
    """vLLM's BlockStored events for a prompt carry the hashes surface.kv_events computes
    from its token ids; a replay returns the batch again; and a GPU-free engine with vLLM's
    block size publishes the same hashes for the same token ids."""
    _, decode, prefix = vllm
    info = registered(prefix)[decode.url]
    assert info.kv_events and info.kv_events_replay and info.kv_hash_algo == "sha256", info
    hasher, size = BlockHasher(info.kv_hash_seed), decode.block_size
    sub, _ = kv.subscriber(info.kv_events, kv.poke(decode.url, decode.model, decode.block_size))
    rng = random.Random(uuid.uuid4().int)
    text = " ".join(
        rng.choice(["alpha", "beta", "gamma", "delta", "kv", "zmq"]) + str(rng.randint(0, 999)) for _ in range(120)
    )
    ids = httpx.post(f"{decode.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60).json()["tokens"]
    want = hasher.external(ids, size)
    assert want, f"a prompt of {len(ids)} tokens fills no block of {size}"

    def published(engine: Engine, sub) -> list[tuple[int, object]]:
        body = {"model": engine.model, "prompt": ids, "max_tokens": 1}
        assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120).status_code == 200
        return kv.received_until(sub, lambda b: set(want) <= {h for e in kv.stored(b) for h in e.block_hashes}, "store")

    batches = published(decode, sub)
    sub.close(linger=0)
    ours = [e for e in kv.stored(batches) if set(e.block_hashes) <= set(want)]
    assert [h for e in ours for h in e.block_hashes] == want
    assert ours[0].parent_block_hash is None and ours[0].token_ids[:size] == ids[:size]
    seq, batch = next((s, b) for s, b in batches if ours[0] in b.events)
    assert (seq, batch) in kv.replayed(info.kv_events_replay, seq)

    events_port = free_port()
    sim = start_sim_worker(tmp_path, "--block-size", str(size), "--kv-events-port", str(events_port))
    try:
        sim_sub, _ = kv.subscriber(f"tcp://127.0.0.1:{events_port}", kv.poke(sim.url, sim.model, size))
        theirs = [e for e in kv.stored(published(sim, sim_sub)) if set(e.block_hashes) <= set(want)]
        assert [h for e in theirs for h in e.block_hashes] == want
        sim_sub.close(linger=0)
    finally:
        stop(sim)


def test_the_kv_index_built_from_vllms_events_predicts_its_prefix_cache_hits(vllm):
    """The gateway's index (gateway.engines.kv_index), fed by its subscriber from vLLM's own
    events, predicts the prompt tokens vLLM takes from its prefix cache for the next
    request: the vllm:prefix_cache_hits delta, for a prompt that extends an earlier one, one
    that shares only its head, and one it never saw."""
    _, decode, prefix = vllm
    info = registered(prefix)[decode.url]
    size = decode.block_size
    rng = random.Random(uuid.uuid4().int)

    def prompt(words: int) -> list[int]:
        text = " ".join(rng.choice(["alpha", "beta", "kv", "zmq"]) + str(rng.randint(0, 999)) for _ in range(words))
        return httpx.post(f"{decode.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60).json()["tokens"]

    def complete(ids: list[int], salt: str | None = None) -> None:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "cache_salt": salt}
        assert httpx.post(f"{decode.url}/v1/completions", json=body, timeout=120).status_code == 200

    first = prompt(120)
    extended, head, fresh = first + prompt(40), first[: 3 * size + 5] + prompt(30), prompt(60)

    async def predicted_and_seen() -> list[tuple[int, int]]:
        index = KVIndex()
        registry = CollectorRegistry()
        dropped = Family(PromCounter("dropped", "", ["reason"], registry=registry))
        subscriber = KVSubscriber(index, PromCounter("malformed", "", registry=registry), dropped)
        subscriber.follow([info])

        async def synced() -> None:  # a probe block of its own, stored and seen: every event before it is in
            salt, probe = uuid.uuid4().hex, [7] * (size + 1)
            await asyncio.to_thread(complete, probe, salt)
            chain, deadline = request_hashes(BlockHasher(info.kv_hash_seed), probe, size, salt), time.monotonic() + 60
            while index.cached_blocks(info.worker_id, chain) != 1:
                assert time.monotonic() < deadline, "vLLM's events did not reach the index"
                await asyncio.sleep(0.05)

        out = []
        try:
            await synced()
            await asyncio.to_thread(complete, first)
            for ids in (extended, head, fresh):
                await synced()
                hashing = subscriber.hashing([info.worker_id])
                want = cached_tokens(index, hashing, ids, None)[info.worker_id]
                before = await asyncio.to_thread(decode.metrics)
                await asyncio.to_thread(complete, ids)
                queried = before.get("vllm:prefix_cache_queries_total", 0) + len(ids)
                after = await asyncio.to_thread(
                    decode.metrics_once, lambda m, q=queried: m.get("vllm:prefix_cache_queries_total", 0) >= q
                )
                out.append((want, int(after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"])))
        finally:
            await subscriber.close()
        return out

    seen = asyncio.run(predicted_and_seen())
    assert [w for w, _ in seen] == [h for _, h in seen], seen
    assert seen[0][0] >= len(first) // size * size - size and seen[1][0] == 3 * size and seen[2][0] == 0, seen


def test_sigterm_drains_the_decode_worker(vllm, gateways):
    """Last in the module: it stops the decode engine. A stream in flight finishes; new
    sessions find no decode worker meanwhile; the entry leaves the registry; exit 0."""
    _, decode, prefix = vllm
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count slowly."}], "stream": True,
            "max_tokens": 24, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{gateways[1]}/v1/chat/completions", json=body, timeout=300) as stream:
        lines = (line for line in stream.iter_lines() if line)
        first = next(lines, "")
        assert stream.status_code == 200 and first.startswith("data: "), (stream.status_code, first)
        worker_id = registered(prefix)[decode.url].worker_id
        decode.child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        # .get: an entry that lapsed in a stall on this loaded machine returns with the drain's beat
        while not getattr(registered(prefix).get(decode.url), "draining", False):
            assert time.monotonic() < deadline, "the worker never announced draining"
            time.sleep(0.2)
        # The gateway's own view, not a sleep: under load its registry refresh can lag the
        # mark, and a session it still bound to the engine would be served there (unbounded,
        # it would hold the drain for as long as vLLM takes to say 2,000 tokens).
        deadline = time.monotonic() + 60
        while worker_id in (seen := httpx.get(f"{gateways[1]}/readyz", timeout=30).json())["workers"]:
            if worker_id in seen["draining"]:
                break
            assert time.monotonic() < deadline, "the gateway never saw the worker draining"
            time.sleep(0.2)
        fresh = {"model": MODEL, "messages": [{"role": "user", "content": "a new session"}], "max_tokens": 4}
        refused = httpx.post(f"{gateways[1]}/v1/chat/completions", json=fresh, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 24
    assert decode.child.process.wait(timeout=120) == 0
    assert decode.url not in registered(prefix)


# -- KV events ------------------------------------------------------------------------------
