"""The `ampd` command line."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ampd import terminal
from ampd.planning import ItlRuleOption, PolicyOption, plan_command, simulate_command, trace_app
from bench.commands import bench_app
from perfmodel.catalog import GPUS, MODELS
from perfmodel.profile import DEFAULT_PROFILE, PROFILES_DIR, load_profile, shipped_profiles
from perfmodel.slo import ItlRule
from surface.redis_address import RedisAddress
from surface.registry import reachable_host

app = typer.Typer(help="ampd: a gateway for multi-round LLM inference under PD disaggregation.", no_args_is_help=True)
worker_app = typer.Typer(help="Run an inference worker.", no_args_is_help=True)
profile_app = typer.Typer(help="Performance-model profiles.", invoke_without_command=True)
app.add_typer(worker_app, name="worker")
app.add_typer(profile_app, name="profile")
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")
sessions_app = typer.Typer(help="Sessions a gateway served.", no_args_is_help=True)
app.add_typer(sessions_app, name="sessions")
workers_app = typer.Typer(help="The engines of a deployment and their roles.", invoke_without_command=True)
app.add_typer(workers_app, name="workers")
app.command("simulate")(simulate_command)
app.command("plan")(plan_command)
console = terminal.console()


def _readable_redis_url(url: str | None) -> str | None:
    """A Redis URL as every process reads it (surface.redis_address): a malformed one stops
    the command before it starts anything."""
    if url is not None:
        try:
            RedisAddress.parse(url)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    return url


def _check_role(role: str) -> None:
    if role not in ("prefill", "decode", "both"):
        raise typer.BadParameter("role must be prefill, decode or both")


@worker_app.command("sim")
def worker_sim(
    role: Annotated[
        str, typer.Option(help="prefill, decode or both (vLLM's kv_producer/kv_consumer/kv_both)")
    ] = "both",
    port: Annotated[int, typer.Option(help="HTTP port (also the KV side channel)")] = 8000,
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    profile: Annotated[str, typer.Option(help="shipped profile name or a profile file")] = DEFAULT_PROFILE,
    speed: Annotated[float, typer.Option(help="run this many times faster than the modelled GPU")] = 1.0,
    served_model_name: Annotated[str | None, typer.Option(help="model name clients use")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="context length served")] = None,
    block_size: int = 16,
    num_blocks: Annotated[int, typer.Option(help="KV blocks; 0 = from the profile's memory model")] = 0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    long_prefill_token_threshold: Annotated[
        int, typer.Option(help="a request prefills at most this many tokens a step (vLLM's); 0: no cap")
    ] = 0,
    step_target_ms: Annotated[
        float,
        typer.Option(
            envvar="AMPD_STEP_TARGET_MS", help="while requests decode, prefill what keeps a step this short; 0: off"
        ),
    ] = 0.0,
    enable_prefix_caching: bool = True,
    default_output_tokens: Annotated[int, typer.Option(help="reply length when no script sets one")] = 32,
    enable_prompt_tokens_details: bool = False,
    kv_load_failure_policy: Annotated[str, typer.Option(help="fail or recompute")] = "fail",
    advertise_host: Annotated[str | None, typer.Option(help="host peers use for the KV side channel")] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="register in this Redis (worker registry)", callback=_readable_redis_url)
    ] = None,
    redis_prefix: str = "ampd",
    log_level: str = "warning",
    kv_events: Annotated[bool, typer.Option(help="publish KV events over ZMQ as vLLM does")] = True,
    kv_events_port: Annotated[int, typer.Option(help="KV events' PUB port; 0: any free one")] = 0,
    kv_events_replay_port: Annotated[int, typer.Option(help="KV events' replay port; 0: any free one")] = 0,
) -> None:
    """The GPU-free engine: vLLM's HTTP surface over a simulated v1 engine core."""
    import os

    import uvicorn

    from rounds.engine.scheduler import SchedulerConfig
    from surface.kv_events import hash_seed
    from workers.sim.server import WorkerConfig, create_app

    _check_role(role)
    if kv_load_failure_policy not in ("fail", "recompute"):
        raise typer.BadParameter("kv-load-failure-policy must be fail or recompute")
    config = WorkerConfig(
        profile=load_profile(profile),
        role=role,  # type: ignore[arg-type]
        port=port,
        advertise_host=advertise_host or reachable_host(host),
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        speed=speed,
        scheduler=SchedulerConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            step_target_s=step_target_ms / 1000,
            enable_prefix_caching=enable_prefix_caching,
        ),
        default_output_tokens=default_output_tokens,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        kv_events=kv_events,
        kv_events_port=kv_events_port,
        kv_events_replay_port=kv_events_replay_port,
        kv_hash_seed=hash_seed(dict(os.environ)),
    )
    uvicorn.run(create_app(config), host=host, port=port, log_level=log_level, access_log=False)


@worker_app.command("vllm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker_vllm(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="model name or folder vLLM serves")],
    role: Annotated[str, typer.Option(help="prefill, decode or both: the work gateways send it")] = "both",
    tp: Annotated[int, typer.Option(help="tensor-parallel degree")] = 1,
    port: int = 8000,
    host: Annotated[str, typer.Option(help="interface vLLM listens on")] = "0.0.0.0",
    advertise_host: Annotated[
        str | None, typer.Option(help="host gateways and peer engines use (default: this machine's)")
    ] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model name clients use")] = None,
    side_channel_port: Annotated[int, typer.Option(help="NIXL handshake port")] = 5600,
    kv_buffer_device: Annotated[str, typer.Option(help="cuda, or cpu for vLLM's CPU build")] = "cuda",
    profile: Annotated[
        str, typer.Option(help="performance profile routing uses (see `ampd profile --worker`)")
    ] = DEFAULT_PROFILE,
    python: Annotated[
        str | None, typer.Option(envvar="AMPD_VLLM_PYTHON", help="interpreter vLLM is installed in")
    ] = None,
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", callback=_readable_redis_url)] = (
        "redis://127.0.0.1:6379/0"
    ),
    redis_prefix: str = "ampd",
    ready_timeout: Annotated[float, typer.Option(help="seconds vLLM may take to serve")] = 600.0,
    drain_timeout: Annotated[float, typer.Option(help="seconds SIGTERM waits for requests to finish")] = 300.0,
    step_sizing: Annotated[
        bool,
        typer.Option(help="run ampd's scheduler in vLLM (a gateway whose policy sizes steps assigns its target)"),
    ] = True,
    step_target_ms: Annotated[
        float,
        typer.Option(
            envvar="AMPD_STEP_TARGET_MS",
            help="ampd's scheduler: while requests decode, size each step to this until one is assigned; 0 = off",
        ),
    ] = 0.0,
    step_log: Annotated[Path | None, typer.Option(help="with step sizing: a JSON line per step here")] = None,
    kv_events: Annotated[bool, typer.Option(help="vLLM publishes its KV events over ZMQ")] = True,
    kv_events_port: Annotated[int, typer.Option(help="KV events' PUB port; 0: a free one")] = 0,
    kv_events_replay_port: Annotated[int, typer.Option(help="KV events' replay port; 0: a free one")] = 0,
    engine_niceness: Annotated[
        int,
        typer.Option(help="once vLLM serves, run it this much lower in CPU priority than this supervisor (0-19)"),
    ] = 0,
) -> None:
    """vLLM's OpenAI server with the NIXL connector, registered while it serves and
    drained on SIGTERM. Arguments after the options go to vLLM unchanged. vLLM runs
    ampd's scheduler (steps priced by --profile, sized to the target a gateway assigns),
    unless --no-step-sizing."""
    import asyncio
    import logging
    import sys
    import tempfile

    from ampd.local_redis import free_port
    from workers.vllm.launch import KVEvents, StepSizing, VllmLaunch
    from workers.vllm.supervisor import supervise

    _check_role(role)
    if kv_buffer_device not in ("cuda", "cpu"):
        raise typer.BadParameter("kv-buffer-device must be cuda or cpu")
    if step_target_ms < 0:
        raise typer.BadParameter("--step-target-ms is 0 (off until assigned) or more")
    if not 0 <= engine_niceness <= 19:
        raise typer.BadParameter("--engine-niceness is 0 to 19")
    if not step_sizing and (step_target_ms or step_log):
        raise typer.BadParameter("--step-target-ms and --step-log need ampd's scheduler (drop --no-step-sizing)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ampd worker vllm: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    launch = VllmLaunch(
        model=model,
        role=role,  # type: ignore[arg-type]
        tp=tp,
        port=port,
        host=host,
        advertise_host=advertise_host or reachable_host(host),
        served_model_name=served_model_name,
        side_channel_port=side_channel_port,
        kv_buffer_device=kv_buffer_device,  # type: ignore[arg-type]
        python=python or sys.executable,
        extra_args=tuple(ctx.args),
        step_sizing=StepSizing(tempfile.mkdtemp(prefix="ampd-vllm-step-"), str(step_log.resolve()) if step_log else "")
        if step_sizing
        else None,
        kv_events=KVEvents(kv_events_port or free_port(), kv_events_replay_port or free_port()) if kv_events else None,
        niceness=engine_niceness,
    )
    run = supervise(
        launch, load_profile(profile), redis_url, redis_prefix, ready_timeout, drain_timeout_s=drain_timeout,
        step_target_ms=step_target_ms,
    )  # fmt: skip
    raise typer.Exit(asyncio.run(run))


@app.command()
def gateway(
    port: int = 8000,
    host: str = "127.0.0.1",
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", callback=_readable_redis_url)] = (
        "redis://127.0.0.1:6379/0"
    ),
    redis_prefix: str = "ampd",
    redis_failover_wait: Annotated[
        float, typer.Option(help="with Sentinel: seconds a round's writes wait for a primary (a failover)")
    ] = 30.0,
    redis_replica_ack_ms: Annotated[
        int, typer.Option(help="with Sentinel: ms a round's writes wait for a replica's acknowledgement; 0: none")
    ] = 500,
    policy: PolicyOption = "ampd",
    placement: Annotated[
        str,
        typer.Option(
            help="where sessions bind and remote prefills go: memory, ampd, dynamo-kv, llmd-prefix, sglang-cache"
        ),
    ] = "memory",
    alpha: float = 0.9,
    beta: float = 0.85,
    reorder_window: int = 3,
    ttft_slo: Annotated[
        float | None, typer.Option(help="TTFT threshold in seconds (default: scale x unloaded)")
    ] = None,
    itl_slo: Annotated[float | None, typer.Option(help="ITL threshold in seconds (default: scale x unloaded)")] = None,
    slo_scale: float = 5.0,
    itl_slo_metric: ItlRuleOption = "mean",
    role_plan: Annotated[
        str | None, typer.Option(envvar="AMPD_ROLE_PLAN", help="an elastic pool's split by load, JSON (`ampd plan`)")
    ] = None,
    prefill_slots: int = 1,
    max_queue: int = 1024,
    api_key: Annotated[
        list[str] | None, typer.Option(envvar="AMPD_API_KEYS", help="accepted key (repeat); 'sha256:<hex>' for hashed")
    ] = None,
    api_keys_file: Annotated[
        Path | None,
        typer.Option(help="keys, one a line: KEY [tenant=NAME]; re-read when it changes or on SIGHUP"),
    ] = None,
    worker: Annotated[list[str] | None, typer.Option(help="static worker: ROLE=URL[@PROFILE[@SPEED]] (repeat)")] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="another name clients may call the engines' model by, listed first in /v1/models (repeat)"),
    ] = None,
    server_tools: Annotated[
        str, typer.Option(help="server-side tools requests may enable")
    ] = "python,retrieve,calculator",
    max_tool_rounds: Annotated[int, typer.Option(help="server tool rounds per request")] = 8,
    migration_limit: Annotated[
        int, typer.Option(help="times a round's stream may move off a lost decode worker; 0: never")
    ] = 3,
    otlp_endpoint: Annotated[
        str | None, typer.Option(envvar="OTEL_EXPORTER_OTLP_ENDPOINT", help="export per-round spans (OTLP/HTTP)")
    ] = None,
    log_level: str = "warning",
    log_content: Annotated[
        bool, typer.Option(help="log every exchange's messages and reply; off, no prompt text reaches a log")
    ] = False,
    processes: Annotated[
        int, typer.Option(min=1, help="gateway processes sharing the port, each a replica of its own")
    ] = 1,
    access_log: Annotated[
        str,
        typer.Option(help="a JSON line per request to this file (--processes: NAME.<pid>.log each); '-': stderr; off"),
    ] = "ampd-access.log",
    access_log_max_bytes: Annotated[int, typer.Option(help="size at which the access log rotates")] = 100 * 2**20,
    access_log_backups: Annotated[int, typer.Option(help="rotated access logs kept")] = 5,
) -> None:
    """The coordinator: OpenAI-compatible API with AMPD routing and prefill reordering."""
    from pydantic import ValidationError

    from gateway.apis.app import serve
    from gateway.config import GatewayConfig, StaticWorker
    from gateway.tenancy import Keyring

    static = []
    for spec in worker or []:
        role, _, rest = spec.partition("=")
        url, *extra = rest.split("@")
        fields = {"url": url, "role": role}
        if extra:
            fields["profile"] = extra[0]
        if len(extra) > 1:
            fields["speed"] = float(extra[1])
        static.append(StaticWorker.model_validate(fields))
    try:
        plan = json.loads(role_plan) if role_plan else None
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--role-plan is not JSON: {exc}") from exc
    try:
        config = GatewayConfig(
            redis_url=redis_url,
            redis_failover_wait_s=redis_failover_wait,
            redis_replica_ack_ms=redis_replica_ack_ms,
            key_prefix=redis_prefix,
            policy=policy,
            placement=placement,  # type: ignore[arg-type]
            alpha=alpha,
            beta=beta,
            reorder_window=reorder_window,
            ttft_slo_s=ttft_slo,
            itl_slo_s=itl_slo,
            slo_scale=slo_scale,
            itl_slo_metric=itl_slo_metric,
            role_plan=plan,
            prefill_slots=prefill_slots,
            max_queue=max_queue,
            api_keys=tuple(api_key or ()),
            api_keys_file=api_keys_file,
            access_log=access_log,
            access_log_max_bytes=access_log_max_bytes,
            access_log_backups=access_log_backups,
            static_workers=tuple(static),
            served_model_names=tuple(served_model_name or ()),
            server_tools=tuple(t for t in server_tools.split(",") if t),
            max_tool_rounds=max_tool_rounds,
            migration_limit=migration_limit,
            log_content=log_content,
        )
        Keyring(config.api_keys, config.api_keys_file)  # a bad keys file stops it here, with its line
    except (ValidationError, OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    serve(config, host, port, processes, otlp_endpoint, log_level)


@app.command()
def up(
    redis_url: Annotated[
        str, typer.Option(envvar="REDIS_URL", help="Redis to use if it answers", callback=_readable_redis_url)
    ] = "redis://127.0.0.1:6379/0",
    gateway_port: int = 8000,
    prefill_port: int = 8101,
    decode_port: int = 8102,
    profile: str = DEFAULT_PROFILE,
    speed: float = 1.0,
    policy: Annotated[
        str | None, typer.Option(help="default: the deployment's, else ampd (elastic with --pool)")
    ] = None,
    pool: Annotated[
        int, typer.Option(help="instead of a prefill and a decode worker: this many whose roles the gateway assigns")
    ] = 0,
    deployment: Annotated[Path | None, typer.Option(help="worker pools from `ampd plan` (deployment.json)")] = None,
    itl_slo_metric: Annotated[
        ItlRule | None,
        typer.Option(help="a round's ITL is judged by its mean, p95 or max gap (default: the deployment's, else mean)"),
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="another name clients may call the engines' model by, listed first in /v1/models (repeat)"),
    ] = None,
) -> None:
    """Start the local stack: Redis, GPU-free prefill and decode workers, a tools worker, the gateway."""
    from pydantic import ValidationError

    from ampd.stack import run_stack
    from planner.plan import load_deployment, role_plan_json

    workers = [("both", profile)] * pool if pool > 0 else [("prefill", profile), ("decode", profile)]
    policy = policy or ("elastic" if pool > 0 else None)
    gateway_args = [arg for name in served_model_name or () for arg in ("--served-model-name", name)]
    if deployment is not None:
        try:
            plan = load_deployment(deployment)
        except (OSError, ValidationError) as exc:
            raise typer.BadParameter(f"{deployment}: {exc}") from exc
        if plan.pool is not None:
            workers = [("both", plan.pool.profile)] * plan.pool.replicas
        else:
            assert plan.prefill is not None and plan.decode is not None  # the file's validator sees to it
            workers = [("prefill", plan.prefill.profile)] * plan.prefill.replicas
            workers += [("decode", plan.decode.profile)] * plan.decode.replicas
        if plan.role_plan is not None:
            gateway_args += ["--role-plan", role_plan_json(plan.role_plan)]
        policy = policy or plan.policy
        itl_slo_metric = itl_slo_metric or plan.itl_rule
    raise typer.Exit(
        run_stack(
            console,
            redis_url,
            gateway_port,
            prefill_port,
            decode_port,
            workers,
            speed,
            policy or "ampd",
            itl_slo_metric or "mean",
            gateway_args,
        )  # fmt: skip
    )


@app.command("tools-worker")
def tools_worker(
    redis_url: Annotated[str, typer.Option(envvar="REDIS_URL", callback=_readable_redis_url)] = (
        "redis://127.0.0.1:6379/0"
    ),
    redis_prefix: str = "ampd",
    workers: Annotated[int, typer.Option(help="worker processes")] = 1,
) -> None:
    """rq workers that run the gateway's server-side tool calls (python, retrieve, calculator)."""
    from tools_sandbox.worker import run_workers, work

    if workers > 1:
        raise typer.Exit(run_workers(redis_url, redis_prefix, workers))
    work(RedisAddress.parse(redis_url).client(), redis_prefix)


RedisOption = Annotated[
    str, typer.Option(envvar="REDIS_URL", help="the deployment's Redis", callback=_readable_redis_url)
]


@workers_app.callback()
def workers_list(
    ctx: typer.Context,
    redis_url: RedisOption = "redis://127.0.0.1:6379/0",
    redis_prefix: str = "ampd",
) -> None:
    """The registered engines: what each can do, the role gateways give it, and since when."""
    if ctx.invoked_subcommand is not None:
        return
    import asyncio
    import time

    from gateway.state.role_store import RoleStore
    from surface.registry import heartbeat_client, live_workers

    async def read():
        redis = heartbeat_client(redis_url)
        try:
            infos = await live_workers(redis, redis_prefix)
            return infos, await RoleStore(redis, redis_prefix).load([i.worker_id for i in infos])
        finally:
            await redis.aclose()

    try:
        infos, roles = asyncio.run(read())
    except OSError as exc:
        console.print(f"[red]{redis_url} unreachable: {exc}[/red]")
        raise typer.Exit(1) from exc
    table = Table("engine", "url", "model", "registered as", "role (pool)", "for", title=f"{len(infos)} engines")
    for info in infos:
        a = roles.get(info.worker_id)
        role = f"{a.role} ({a.pool})" if a else f"{info.role} (as registered)"
        held = f"{time.time() - a.since:,.0f} s" if a else "-"
        table.add_row(info.worker_id, info.url, info.model, info.role, role + (" draining" if info.draining else ""),
                      held)  # fmt: skip
    console.print(table)


def _registry(redis_url: str, action):
    """``action(redis)`` against the worker registry; its refusal (ValueError) or an unreachable
    Redis ends the command with the message."""
    import asyncio

    from surface.registry import heartbeat_client

    async def run():
        redis = heartbeat_client(redis_url)
        try:
            return await action(redis)
        finally:
            await redis.aclose()

    try:
        return asyncio.run(run())
    except (ValueError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc


async def _registered(redis, prefix: str, worker_id: str):
    """The registered engine ``worker_id``, or a ValueError naming the ones there are."""
    from surface.registry import live_workers

    known = {i.worker_id: i for i in await live_workers(redis, prefix)}
    if worker_id not in known:
        raise ValueError(f"no engine {worker_id!r}; registered: {', '.join(sorted(known)) or 'none'}")
    return known[worker_id]


@workers_app.command("set")
def workers_set(
    worker_id: str,
    role: Annotated[str, typer.Argument(help="prefill, decode or mixed")],
    redis_url: RedisOption = "redis://127.0.0.1:6379/0",
    redis_prefix: str = "ampd",
) -> None:
    """Give an engine registered as `both` another role; every gateway applies it at its next refresh."""
    from gateway.elastic_live import set_role
    from rounds.roles import ROLES

    if role not in ROLES:
        raise typer.BadParameter(f"role must be one of {', '.join(ROLES)}")

    async def write(redis):
        info = await _registered(redis, redis_prefix, worker_id)
        if info.role != "both":
            raise ValueError(f"{worker_id} is registered as {info.role}: only `both` engines change role")
        return await set_role(redis, redis_prefix, worker_id, role)

    done = _registry(redis_url, write)
    console.print(f"{worker_id}: {done.role} ({done.pool})")


@workers_app.command("step-target")
def workers_step_target(
    worker_id: str,
    target_ms: Annotated[float, typer.Argument(help="milliseconds a step keeps to while requests decode; 0: off")],
    redis_url: RedisOption = "redis://127.0.0.1:6379/0",
    redis_prefix: str = "ampd",
) -> None:
    """Give an engine another step target; it applies it within a second. Where the
    gateways' policy sizes steps (dynaserve, elastic-split under a tail rule) they assign
    their own and put it back."""
    from surface.registry import set_step_target_ms

    if target_ms < 0:
        raise typer.BadParameter("the target is 0 (off) or more milliseconds")

    async def write(redis) -> None:
        info = await _registered(redis, redis_prefix, worker_id)
        if not info.sized_steps:
            raise ValueError(f"{worker_id} runs vLLM's own scheduler (started with --no-step-sizing)")
        await set_step_target_ms(redis, redis_prefix, worker_id, target_ms)

    _registry(redis_url, write)
    console.print(f"{worker_id}: step target {target_ms:g} ms")


@sessions_app.command("show")
def sessions_show(
    session_id: str,
    gateway: Annotated[str, typer.Option(help="the gateway's URL")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(envvar="OPENAI_API_KEY", help="the session's API key")] = None,
) -> None:
    """Every round of a session: route, queue wait, TTFT and ITL (GET /v1/sessions/{id})."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{gateway}/v1/sessions/{session_id}", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        console.print(f"[red]{gateway} unreachable: {exc}[/red]")
        raise typer.Exit(1) from exc
    body = response.json()
    if response.status_code != 200:
        console.print(f"[red]{response.status_code}: {body.get('error', {}).get('message', body)}[/red]")
        raise typer.Exit(1)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:,.1f} ms"

    table = Table("round", "kind", "route", "worker", "l_hist + l_incr", "queue wait", "TTFT", "mean ITL", "tokens",
                  title=f"session {body['id']} on {body['decode_worker']}")  # fmt: skip
    for r in body["rounds"]:
        worker = r["prefill_worker"] if r["route"] == "remote" else r["decode_worker"]
        table.add_row(str(r["round"]), r["kind"], f"{r['route']} ({r['reason']})", worker,
                      f"{r['l_hist']:,} + {r['l_incr']:,}", ms(r["queue_wait_s"]), ms(r["ttft_s"]),
                      ms(r["mean_itl_s"]), str(r["completion_tokens"]))  # fmt: skip
    console.print(table)


@profile_app.callback()
def profile_measure(
    ctx: typer.Context,
    worker: Annotated[
        str | None, typer.Option(help="measure the engine at this URL (vLLM or `ampd worker sim`)")
    ] = None,
    prefill_worker: Annotated[str | None, typer.Option(help="a prefill engine, to time the KV hand-off")] = None,
    model: Annotated[str, typer.Option(help=f"what the engine runs: one of {', '.join(MODELS)}")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")] = "H100",
    tp: int = 1,
    speed: Annotated[float, typer.Option(help="a GPU-free worker's --speed; 1 on real hardware")] = 1.0,
    clock: Annotated[
        str,
        typer.Option(
            help="engine: the engine's own clock (its TTFT, inter-token and KV-pull histograms); client: at the client"
        ),
    ] = "engine",
    out: Annotated[Path | None, typer.Option(help="profile file (default: <model>_<gpu>_tp<N>_measured.json)")] = None,
) -> None:
    """Measure a running engine over a grid and fit its profile (`ampd profile --worker URL`)."""
    if ctx.invoked_subcommand is not None:
        return
    if worker is None:
        console.print(ctx.get_help())
        raise typer.Exit(0)
    import asyncio

    from planner.profiler import profile_worker
    from planner.profiler.fit import report_table

    if model not in MODELS or gpu not in GPUS or clock not in ("engine", "client"):
        raise typer.BadParameter(f"models: {', '.join(MODELS)}; GPUs: {', '.join(GPUS)}; clocks: engine, client")
    path = out or Path(f"{model}_{gpu.lower()}_tp{tp}_measured.json")
    with console.status("measuring") as status:
        _, report = asyncio.run(
            profile_worker(worker, prefill_url=prefill_worker, model=MODELS[model], gpu=GPUS[gpu], tp=tp,
                           speed=speed, out_path=path, clock=clock, progress=status.update)  # type: ignore[arg-type]
        )  # fmt: skip
    console.print(report_table(report))
    console.print(f"wrote {path}")


@profile_app.command("list")
def profile_list() -> None:
    """The shipped profiles and what they predict."""
    table = Table("profile", "KV tokens", "T_pre(0, 700)", "T_pre(2000, 300)", "T_dec(1, 1k)", "T_dec(64, 128k)")
    for name in shipped_profiles():
        prof = load_profile(name)
        table.add_row(
            name,
            f"{prof.kv_capacity_tokens:,}",
            f"{prof.t_pre(0, 700) * 1e3:.1f} ms",
            f"{prof.t_pre(2000, 300) * 1e3:.1f} ms",
            f"{prof.t_dec(1, 1000) * 1e3:.2f} ms",
            f"{prof.t_dec(64, 128_000) * 1e3:.2f} ms",
        )
    console.print(table)


@profile_app.command("roofline")
def profile_roofline(
    model: Annotated[str, typer.Option(help=f"one of {', '.join(MODELS)}")],
    gpu: Annotated[str, typer.Option(help=f"one of {', '.join(GPUS)}")],
    tp: Annotated[int, typer.Option(help="tensor-parallel degree")],
    out: Annotated[Path | None, typer.Option(help="file to write; default: print")] = None,
) -> None:
    """Derive a profile from the roofline of a catalogued model and GPU."""
    from perfmodel.memory import MemoryPlan, fits
    from perfmodel.roofline import roofline_profile

    if model not in MODELS or gpu not in GPUS:
        raise typer.BadParameter(f"unknown model or GPU; models: {', '.join(MODELS)}; GPUs: {', '.join(GPUS)}")
    if not fits(MODELS[model], GPUS[gpu], tp, MemoryPlan()):
        raise typer.BadParameter(f"{model} does not fit on {tp} x {gpu} at {MODELS[model].max_model_len} tokens")
    prof = roofline_profile(MODELS[model], GPUS[gpu], tp)
    if out is None:
        console.print_json(prof.model_dump_json())
    else:
        prof.dump(out)
        console.print(f"wrote {out}")


@profile_app.command("ship")
def profile_ship() -> None:
    """Regenerate the shipped roofline profiles (planner/profiles/)."""
    from perfmodel.roofline import paper_profiles

    for prof in paper_profiles():
        prof.dump(PROFILES_DIR / f"{prof.name}.json")
        console.print(f"{prof.name}: forward fit error {prof.pieces.forward.max_rel_error:.2%}")


@profile_app.command("check")
def profile_check() -> None:
    """The roofline next to DOPD's published Llama-3.3-70B-FP8/H100 measurements."""
    from perfmodel.published import compare_dopd_table_i
    from perfmodel.roofline import roofline_profile

    prof = roofline_profile(MODELS["llama-3.3-70b-fp8"], GPUS["H100"], 1)
    rows = compare_dopd_table_i(prof)
    table = Table("DOPD Table I", "measured", "roofline", "error")
    for row in rows:
        table.add_row(
            row.what, f"{row.measured_s * 1e3:.0f} ms", f"{row.predicted_s * 1e3:.1f} ms", f"{row.rel_error:+.1%}"
        )
    console.print(table)
    errors = [abs(r.rel_error) for r in rows]
    console.print(f"mean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%}")


@profile_app.command("calibrate")
def profile_calibrate(
    kernels: Annotated[
        list[Path] | None,
        typer.Option(help="kernel timings (`ampd profile kernels --out`); default: bench/results/kernels/*.json"),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="write the fitted efficiency and the errors here (JSON)")] = None,
) -> None:
    """Fit the roofline's efficiencies and step overhead jointly to DOPD's Table I and kernel timings."""
    from dataclasses import asdict

    from perfmodel.calibration import FITTED, calibrate, dopd_points, kernel_points
    from perfmodel.roofline import HOPPER_EFFICIENCY

    files = kernels or sorted(Path("bench/results/kernels").glob("*.json"))
    try:
        points = dopd_points()
        for path in files:
            points += kernel_points(json.loads(path.read_text()), path.name)
        result = calibrate(points)
    except (OSError, KeyError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    moved = Table("figure", "shipped", "calibrated", "moved", title="the roofline's constants")
    for name in FITTED:
        before = getattr(HOPPER_EFFICIENCY, name)
        before = HOPPER_EFFICIENCY.compute if before is None else before
        after = getattr(result.efficiency, name)
        scale, unit = (1e3, " ms") if name.endswith("_s") else (1, "")
        moved.add_row(name, f"{before * scale:.3g}{unit}", f"{after * scale:.3g}{unit}", f"{after / before - 1:+.0%}")
    console.print(moved)
    table = Table("source", "points", "shipped: mean |error|, worst", "calibrated: mean |error|, worst",
                  "within 15%", title="relative error of the roofline's price")  # fmt: skip
    for b, a in zip(result.before, result.after, strict=True):
        table.add_row(f"{a.source} ({'fitted' if a.fitted else 'compared'})", str(a.points),
                      f"{b.mean_abs:.1%}, {b.worst:+.1%}", f"{a.mean_abs:.1%}, {a.worst:+.1%} ({a.worst_what})",
                      f"{a.within_15}/{a.points}")  # fmt: skip
    console.print(table)
    if out is not None:
        document = {"efficiency": result.efficiency.model_dump(), "kernels": [str(p) for p in files],
                    "before": [asdict(e) for e in result.before],
                    "after": [asdict(e) for e in result.after]}  # fmt: skip
        out.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {out}")


@profile_app.command("kernels")
def profile_kernels(
    model: Annotated[str, typer.Option(help=f"a dense model: one of {', '.join(MODELS)}")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help=f"the roofline's GPU: one of {', '.join(GPUS)}")] = "H100",
    out: Annotated[Path | None, typer.Option(help="write measurements and comparison here (JSON)")] = None,
    device: Annotated[str, typer.Option(help="torch device to time on (cpu: tests only)")] = "cuda",
    measured: Annotated[
        Path | None, typer.Option(help="compare these measurements (planner/profiler/kernels.py's JSON) instead")
    ] = None,
    layers: Annotated[int | None, typer.Option(help="allocate at most this many layers (scaled up)")] = None,
    tp: Annotated[int, typer.Option(help="time one rank's shard at this tensor-parallel degree")] = 1,
    repeats: int = 10,
) -> None:
    """Time the model's prefill and decode kernels with PyTorch (one TP rank) next to the roofline's price."""
    from dataclasses import asdict

    from planner.profiler.kernels import Shape, check_shape, compare, measure

    if model not in MODELS or gpu not in GPUS:
        raise typer.BadParameter(f"unknown model or GPU; models: {', '.join(MODELS)}; GPUs: {', '.join(GPUS)}")
    spec = MODELS[model]
    try:
        if measured is not None:
            raw = json.loads(measured.read_text())
            check_shape(raw, spec)
        else:
            with console.status("timing kernels") as status:
                raw = measure(Shape.from_dict(spec.model_dump()), device=device, layers=layers, tp=tp,
                              repeats=repeats, progress=status.update)  # fmt: skip
    except (RuntimeError, ValueError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    rows = compare(raw, spec, GPUS[gpu])
    table = Table("step", "measured", "roofline - overhead", "measured / roofline", "TFLOP/s", "TB/s",
                  title=f"{model} on {raw['device']} (TP {raw.get('tp', 1)}) vs the {gpu} roofline")  # fmt: skip
    for r in rows:
        step = f"prefill {r.tokens:,}" if r.kind == "prefill" else f"decode b={r.tokens} c={r.context:,}"
        table.add_row(step, f"{r.measured_s * 1e3:.2f} ms", f"{r.predicted_s * 1e3:.2f} ms", f"{r.ratio:.2f}",
                      f"{r.tflops:.0f}", f"{r.tbps:.2f}")  # fmt: skip
    console.print(table)
    for point in raw["prefill"] + raw["decode"]:
        if "error" in point:
            console.print(f"[red]not timed: {point}[/red]")
    if out is not None:
        comparison = [{**asdict(r), "ratio": r.ratio} for r in rows]
        document = {**raw, "model": model, "roofline_gpu": gpu, "comparison": comparison}
        out.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {out}")


if __name__ == "__main__":
    app()
