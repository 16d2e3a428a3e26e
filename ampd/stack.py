"""`ampd up`: the whole local stack as child processes, stopped together on Ctrl-C.

Redis (found or started), GPU-free workers registered in it - one prefill and one
decode, a pool of workers whose roles the gateway assigns (``--pool``), or the pools a
deployment file from `ampd plan` names - an rq tools worker for server-side tools, and
the gateway in front of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ampd.local_redis import NoRedis, ensure_redis
from ampd.ports import holder, port_taken
from ampd.processes import spawn_gateway, spawn_sim_worker, spawn_tools_worker, tools_worker_ready, wait_healthy
from gateway.config import GatewayConfig
from perfmodel.profile import load_profile
from perfmodel.slo import ItlRule
from rounds.policies import step_target_ms
from tools_sandbox.client import queue_name

STATE_DIR = Path(".ampd")  # logs, the private Redis's directory, and stack.json (what runs where)
REDIS_PREFIX = "ampd"


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def engine_step_target_ms(policy: str, profile: str, speed: float, rule: ItlRule) -> float:
    """The step time a GPU-free engine keeps to while it decodes under ``policy`` (0: none),
    from the SLO the gateway derives for it - as the simulator sets it (rounds.policies.step_target)."""
    config = GatewayConfig()  # what `ampd up` starts the gateway with, but for the policy and rule
    return step_target_ms(policy, config.slo(load_profile(profile), speed), rule, config.beta)


def why_not_start(ports: list[tuple[str, int]]) -> str | None:
    """Why the stack must not start, before it claims anything: a port it would serve on is
    held (by whom, where /proc shows it), or a stack already runs from this directory (its
    stack.json's gateway answers) - its logs and stack.json stay as they are."""
    taken = [f"port {port} ({name}) is in use by {holder(port) or 'another process'}"
             for name, port in ports if port_taken(port)]  # fmt: skip
    if taken:
        flags = "--gateway-port, --prefill-port, --decode-port"
        return "; ".join(taken) + f". Nothing was started: stop it or choose other ports ({flags})."
    with contextlib.suppress(OSError, ValueError, KeyError, httpx.HTTPError):
        gateway = json.loads((STATE_DIR / "stack.json").read_text())["gateway"]
        if httpx.get(f"{gateway}/healthz", timeout=2).status_code == 200:
            running = f"gateway {gateway}, {STATE_DIR}/stack.json"
            return f"a stack already runs from this directory ({running}): stop it first."
    return None


def run_stack(
    console: Console,
    redis_url: str,
    gateway_port: int,
    prefill_port: int,
    decode_port: int,
    workers: list[tuple[str, str]],
    speed: float,
    policy: str,
    itl_rule: ItlRule = "mean",
    gateway_args: list[str] | None = None,
) -> int:
    """``workers`` are (role, profile) pairs; the n-th worker of a role listens on its
    role's port + 2n, so the default pair keeps 8101 and 8102 (a pool's ``both`` workers
    take the prefill ports). Under a policy whose engines size their steps to the ITL rule
    (DynaServe's), each worker gets its step target. Nothing starts, and nothing in
    ``.ampd`` is touched, unless every port is free and no stack runs from here."""
    base = {"prefill": prefill_port, "decode": decode_port, "both": prefill_port}
    targets = {profile: engine_step_target_ms(policy, profile, speed, itl_rule) for _, profile in workers}
    placed = []
    for role, profile in workers:
        n = sum(1 for placed_role, *_ in placed if placed_role == role)
        placed.append((role, profile, n, base[role] + 2 * n, targets[profile]))
    refusal = why_not_start([("gateway", gateway_port)] + [(f"{r} worker {n}", p) for r, _, n, p, _ in placed])
    if refusal:
        console.print(f"[red]{escape(refusal)}[/red]", soft_wrap=True)
        return 1
    STATE_DIR.mkdir(exist_ok=True)
    try:
        redis = ensure_redis(redis_url, STATE_DIR / "redis")
    except NoRedis as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    registry = ["--redis-url", redis.url, "--redis-prefix", REDIS_PREFIX]
    children_workers = [
        spawn_sim_worker(
            f"{role} worker {n} (GPU-free, {profile})",
            port,
            ["--role", role, "--profile", profile, "--speed", str(speed), "--step-target-ms", str(target), *registry],
            log=STATE_DIR / f"{role}-{n}.log",
        )
        for role, profile, n, port, target in placed
    ]
    tools = spawn_tools_worker(redis.url, REDIS_PREFIX, STATE_DIR / "tools.log")
    children = list(children_workers)
    try:
        failed = wait_healthy(children_workers)
        if failed is None and not tools_worker_ready(redis.url, REDIS_PREFIX, tools):
            console.print(f"[red]the tools worker did not come up; see {STATE_DIR}/tools.log[/red]")
            return 1
        if failed is None:
            args = [*registry, "--policy", policy, "--itl-slo-metric", itl_rule, "--access-log",
                    str(STATE_DIR / "access.log"), *(gateway_args or [])]  # fmt: skip
            gateway = spawn_gateway("gateway", gateway_port, args, STATE_DIR / "gateway.log")
            children.append(gateway)
            failed = wait_healthy([gateway], path="/readyz")
        if failed is not None:
            console.print(f"[red]{failed.name} did not come up; see {STATE_DIR}/*.log[/red]")
            return 1
        stack = {
            "redis": redis.url,
            "gateway": gateway.url,
            "workers": [
                {"role": role, "profile": profile, "url": w.url, "step_target_ms": target}
                for (role, profile, _, _, target), w in zip(placed, children_workers, strict=True)
            ],  # fmt: skip
        }
        (STATE_DIR / "stack.json").write_text(json.dumps(stack, indent=2))
        table = Table("service", "address")
        table.add_row("redis", f"{redis.url} ({redis.source})")
        for child in children:
            table.add_row(child.name, child.url)
        table.add_row("tools worker (rq)", f"queue {queue_name(REDIS_PREFIX)}: python, retrieve, calculator")
        console.print(table)
        console.print(
            f"Try: curl -N {gateway.url}/v1/chat/completions -H 'Content-Type: application/json' "
            '-d \'{"messages": [{"role": "user", "content": "Weather in Paris?"}], "stream": true, '
            '"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": '
            '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}\'',
            soft_wrap=True,
        )
        console.print(f"OpenAI SDK: OpenAI(base_url='{gateway.url}/v1', api_key='unused'). Ctrl-C stops everything.")
        # Ctrl-C and SIGTERM stop the stack, also where SIGINT came in ignored (a shell's background job).
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        while tools.poll() is None and all(c.process.poll() is None for c in children):
            time.sleep(0.5)
        console.print("[red]a process exited; stopping the stack[/red]")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for child in reversed(children):
            child.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(tools.pid, signal.SIGTERM)
        tools.wait(timeout=10)
        redis.stop()
