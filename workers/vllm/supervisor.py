"""`ampd worker vllm`: a vLLM engine under a supervisor that registers it, heartbeats,
and drains it on SIGTERM.

The supervisor starts vLLM's OpenAI server (workers.vllm.launch), and only once the
engine answers ``/health`` and lists its model does it register in the worker
registry: registration is the worker's readiness. On SIGTERM or SIGINT it marks the
entry draining (gateways bind no new session and send no new round to it), waits
until the engine has no request running or waiting, deregisters, and only then stops
the engine. If the engine dies, the entry goes at once, not when its TTL lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import httpx

from perfmodel.profile import Profile
from perfmodel.step_correction import PREFILL
from surface.kv_events import hash_seed
from surface.parent_death import end_with_parent
from surface.registry import (
    STEP_TARGET_POLL_S,
    Registration,
    WorkerInfo,
    follow_step_target,
    heartbeat_client,
    node_name,
)
from surface.wire import cache_config, parse_load
from workers.vllm import step_files, tokenizer_files
from workers.vllm.launch import StepSizing, VllmLaunch, server_argv, server_env

log = logging.getLogger(__name__)

POLL_S = 0.5
DRAIN_REPORT_S = 10.0  # how often a drain that waits says on what


async def supervise(
    launch: VllmLaunch,
    profile: Profile,
    redis_url: str,
    prefix: str,
    ready_timeout_s: float = 600.0,
    drain_grace_s: float = 3.0,
    drain_timeout_s: float = 300.0,
    step_target_ms: float = 0.0,
) -> int:
    """Run the engine until it exits or a signal drains it; the exit status to return.
    With step sizing (``launch.step_sizing``) its folder is filled first and removed at the end."""
    if launch.step_sizing is not None:
        step_files.prepare(launch.step_sizing, profile, step_target_ms)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Its own session: a Ctrl-C in the terminal reaches the supervisor only, which drains first.
    # Its own session also survives a supervisor killed hard (a caller's deadline): SIGTERM
    # on the supervisor's death stops it then, as vLLM stops on any SIGTERM. Seen without it:
    # a supervisor SIGKILLed in a test's teardown left its vLLM engine busy-polling a core.
    engine = await asyncio.create_subprocess_exec(
        *server_argv(launch), env=server_env(launch, dict(os.environ)), start_new_session=True,
        preexec_fn=functools.partial(end_with_parent, signal.SIGTERM, os.getpid()),
    )  # fmt: skip
    redis = heartbeat_client(redis_url)
    try:
        async with httpx.AsyncClient(base_url=launch.url, timeout=10.0) as http:
            info = await _wait_ready(engine, http, launch, profile, stop, ready_timeout_s)
            if info is None:
                return 0 if stop.is_set() else 1
            if launch.niceness:
                nice_session(engine.pid, launch.niceness)
            await tokenizer_files.publish(redis, prefix, launch)  # before any gateway sees the engine
            registration = Registration(redis, prefix, info)
            tasks = [asyncio.create_task(registration.run())]
            if launch.step_sizing is not None:
                apply = functools.partial(step_files.set_target, launch.step_sizing)
                following = follow_step_target(redis, prefix, info.worker_id, apply, step_target_ms)
                tasks.append(asyncio.create_task(following))
                tasks.append(asyncio.create_task(_follow_prices(registration, launch.step_sizing)))
            log.info("%s ready at %s (KV %d tokens)", info.worker_id, info.url, info.kv_capacity_tokens)
            exited, stopping = asyncio.create_task(engine.wait()), asyncio.create_task(stop.wait())
            await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not exited.done():
                await registration.drain()
                await _wait_idle(http, drain_grace_s, drain_timeout_s)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if exited.done():
                log.error("vLLM exited with status %s", engine.returncode)
                return engine.returncode or 1
            return 0
    finally:
        await _terminate(engine)
        await redis.aclose()
        if launch.step_sizing is not None:
            shutil.rmtree(launch.step_sizing.folder, ignore_errors=True)


async def _follow_prices(registration: Registration, sizing: StepSizing) -> None:
    """The scheduler's correction of the profile's prefill prices into the registry entry,
    which the next heartbeat carries to the gateways."""
    while True:
        factor = step_files.read_prices(sizing).get(PREFILL)
        if factor is not None and factor != registration.info.prefill_factor:
            registration.info = replace(registration.info, prefill_factor=factor)
        await asyncio.sleep(STEP_TARGET_POLL_S)


def nice_session(session: int, niceness: int) -> None:
    """Every thread of every process in the engine's session niced, once it serves: its
    start is CPU-bound imports and compilation that spin nothing, and niced from the start
    it waited behind every busy process on the host. Serving, its NIXL threads busy-poll a
    core each, and niced they leave the host's other processes their turn. Niceness is per
    thread on Linux, so each thread is reniced (those started later inherit it). Where
    Linux groups a session's processes for the scheduler (autogroup) a process's niceness
    weighs only inside its group, so the group is niced too."""
    for pid in _session_processes(session):
        with contextlib.suppress(OSError):  # a process or thread that ended meanwhile
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
    with contextlib.suppress(OSError):  # no autogroups (another OS, or a kernel without them)
        Path(f"/proc/{session}/autogroup").write_text(str(niceness))


def _session_processes(session: int) -> list[int]:
    """The processes whose session is ``session`` (the sixth field of /proc/PID/stat)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == session:
                    found.append(int(entry.name))
    return found


async def _wait_ready(
    engine: asyncio.subprocess.Process,
    http: httpx.AsyncClient,
    launch: VllmLaunch,
    profile: Profile,
    stop: asyncio.Event,
    timeout_s: float,
) -> WorkerInfo | None:
    """The registry entry, once the engine serves; None if it died, timed out or was stopped."""
    deadline = time.monotonic() + timeout_s
    while engine.returncode is None and not stop.is_set() and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            if (await http.get("/health")).status_code == 200:
                models = [card["id"] for card in (await http.get("/v1/models")).json()["data"]]
                if launch.model_name in models:
                    blocks = cache_config((await http.get("/metrics")).text)
                    capacity = blocks[0] * blocks[1] if blocks else profile.kv_capacity_tokens
                    events, replay = launch.kv_events_endpoints
                    return WorkerInfo(
                        launch.worker_id, launch.role, launch.url, launch.model_name, profile, 1.0, capacity,
                        prefill_chunk=launch.prefill_chunk, node=node_name(launch.advertise_host),
                        sized_steps=launch.step_sizing is not None, splits=launch.splits,
                        kv_events=events, kv_events_replay=replay, kv_hash_algo=launch.kv_hash_algo,
                        kv_hash_seed=hash_seed(server_env(launch, dict(os.environ))),
                    )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)
    if engine.returncode is None and not stop.is_set():
        log.error("vLLM did not serve %s within %.0f s", launch.model_name, timeout_s)
    return None


async def _wait_idle(http: httpx.AsyncClient, grace_s: float, timeout_s: float) -> None:
    """Until nothing runs or waits on the engine, twice in a row. The grace first lets
    every gateway see the draining mark (they re-read the registry about every second);
    the second look covers a prefill whose KV a decode worker is about to pull."""
    await asyncio.sleep(grace_s)
    deadline = time.monotonic() + timeout_s
    said = time.monotonic()
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        try:
            load = parse_load((await http.get("/metrics")).text)
            quiet = quiet + 1 if load.running == 0 and load.waiting == 0 else 0
        except httpx.HTTPError:
            return  # the engine is gone: nothing left to drain
        if quiet == 0 and time.monotonic() - said >= DRAIN_REPORT_S:  # what a slow drain waits on, for the operator
            log.info("draining: %d requests running, %d waiting on the engine", load.running, load.waiting)
            said = time.monotonic()
        await asyncio.sleep(POLL_S)
    if quiet < 2:
        log.warning("drain timed out after %.0f s with requests still on the engine", timeout_s)


async def _terminate(engine: asyncio.subprocess.Process, timeout_s: float = 30.0) -> None:
    if engine.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(engine.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
        await engine.wait()
