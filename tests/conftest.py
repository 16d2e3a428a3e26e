"""Fixtures: real worker processes on free ports; ``unit`` tests kept pure."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.engines import Engine, start_sim_worker, stop


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="module")
def pd_pair(workdir) -> Iterator[tuple[Engine, Engine]]:
    """One prefill and one decode GPU-free worker, 50x faster than the modelled H100."""
    common = ("--speed", "50", "--block-size", "16")
    prefill = start_sim_worker(workdir, "--role", "prefill", *common)
    decode = start_sim_worker(workdir, "--role", "decode", *common)
    yield prefill, decode
    stop(prefill)
    stop(decode)


@pytest.fixture(scope="module")
def engine(pd_pair) -> Engine:
    """The engine the protocol tests talk to: the decode worker of the pair."""
    return pd_pair[1]


def _runs_vllm(module: str) -> bool:
    """Modules named test_vllm* start real vLLM engines (tests/test_repository_hygiene.py
    holds every module that takes VLLM_TIMEOUT to the name)."""
    return Path(module).name.startswith("test_vllm")


def pytest_collection_modifyitems(config, items):
    """The vLLM modules first: under xdist they are one chain, the longest."""
    items.sort(key=lambda item: not _runs_vllm(item.nodeid.split("::", 1)[0]))  # stable: the order stays


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the suite on several xdist workers. A module's tests stay on one
    worker, so its module-scoped engines and gateways start once; and the modules that
    start vLLM engines are one unit of work, on one worker, one module after another
    (collected first, they start first): each module's engines busy-poll a core each with
    NIXL's progress thread, and two modules' engines at once would starve each other and
    every other test."""
    return by_module_scheduler()(config, log)


def by_module_scheduler() -> type:
    """xdist's scope scheduler, its units our modules (its private ``_split_scope``, pinned
    and checked in tests/test_library_seams.py). Imported here: xdist is only on `make test`'s path."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "vllm" if _runs_vllm(module) else module

    return ByModule


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test of a module that defines ``failure_context()`` (its engines' logs)
    reports it too: an intermittent engine failure is then diagnosable from CI's output."""
    report = (yield).get_result()
    context = getattr(item.module, "failure_context", None)
    if report.failed and context is not None:
        report.sections.append(("engine logs", context()))


TEST_DATABASE = "redis://127.0.0.1:6379/13"
RUNS_KEY = "ampd-tests:runs"  # the pids of the test runs using the database now


@pytest.fixture(scope="session", autouse=True)
def clean_test_database(request):
    """Everything the suite writes to Redis lives in its own database (13); the last run to
    end empties it, rq's job and queue keys included. Another run still going on this
    machine (its pid alive) keeps it: emptying it under that run once took the workers'
    registry and roles from its tests mid-way. A run of ``unit`` tests alone touches no
    Redis and takes no part."""
    if all(item.get_closest_marker("unit") is not None for item in request.session.items):
        yield
        return
    db = redis.Redis.from_url(TEST_DATABASE)
    db.sadd(RUNS_KEY, os.getpid())
    yield
    db.srem(RUNS_KEY, os.getpid())
    if not any(_alive(int(pid)) for pid in db.smembers(RUNS_KEY)):
        db.flushdb()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@pytest.fixture(autouse=True)
def unit_tests_stay_pure(request, monkeypatch):
    """A test marked ``unit`` starts no process and opens no connection: the marker is a promise."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*_, **__):
        raise AssertionError(f"{request.node.nodeid} is marked unit but starts a process or opens a connection")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
