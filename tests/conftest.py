"""Fixtures: real worker processes on free ports."""

from __future__ import annotations

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test of a module that defines ``failure_context()`` (its engines' logs)
    reports it too: an intermittent engine failure is then diagnosable from CI's output."""
    report = (yield).get_result()
    context = getattr(item.module, "failure_context", None)
    if report.failed and context is not None:
        report.sections.append(("engine logs", context()))


@pytest.fixture(scope="session", autouse=True)
def clean_test_database():
    """Everything the suite writes to Redis lives in its own database (13); empty it at the end,
    rq's job and queue keys included."""
    yield
    redis.Redis.from_url("redis://127.0.0.1:6379/13").flushdb()
