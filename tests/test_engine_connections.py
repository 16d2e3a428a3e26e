"""The gateway's own HTTP/1.1 connections for decode streams (gateway.engines.connections),
against a real HTTP server in a subprocess (aiohttp's) that can stream, cut a stream,
answer an error, stall, hang up on a request, and say which connections it has seen, which
requests it saw end early and which it hung up on."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from ampd.local_redis import free_port
from gateway.engines.connections import EngineConnections, Lost, TimedOut

SERVER = r"""
import asyncio, sys
from aiohttp import web

peers, aborted, hung_up, served = set(), [], [], {}

async def stream(request):
    peers.add(request.transport.get_extra_info("peername"))
    n, gap = int(request.query.get("n", "5")), float(request.query.get("gap", "0"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        for i in range(n):
            await response.write(b"data: %d\n\n" % i)
            await asyncio.sleep(gap)
            if request.path == "/cut" and i == 1:
                request.transport.close()
                return response
    except (asyncio.CancelledError, ConnectionResetError):
        aborted.append(request.query.get("id"))
        raise
    await response.write_eof()
    return response

async def error(request):
    peers.add(request.transport.get_extra_info("peername"))
    return web.json_response({"error": {"message": "no such model"}}, status=404)

async def stall(request):
    await asyncio.sleep(3600)

async def hang_up(request):
    # The connection closed unanswered: always (?always=1), else where it served before - a
    # kept-alive connection closed by the server's keep-alive timer as the request came.
    peer = request.transport.get_extra_info("peername")
    peers.add(peer)
    served[peer] = served.get(peer, 0) + 1
    if request.query.get("always") or served[peer] > 1:
        hung_up.append(request.query.get("id"))
        request.transport.close()
        await asyncio.sleep(3600)
    return web.Response(body=b"answered")

async def seen(request):
    return web.json_response({"connections": len(peers), "aborted": aborted, "hung_up": hung_up})

app = web.Application(handler_args={"handler_cancellation": True})
app.router.add_post("/stream", stream)
app.router.add_post("/cut", stream)
app.router.add_post("/error", error)
app.router.add_post("/stall", stall)
app.router.add_post("/hang-up", hang_up)
app.router.add_get("/seen", seen)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


@pytest.fixture
def server() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/seen", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the test server did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        process.kill()
        process.wait()


def seen(url: str) -> dict:
    return httpx.get(f"{url}/seen", timeout=10).json()


def connections(keepalive_s: float = 4.0, timeout_s: float = 30.0) -> EngineConnections:
    return EngineConnections(keepalive_s=keepalive_s, connect_timeout_s=5.0, timeout_s=timeout_s)


async def body_of(pool: EngineConnections, url: str) -> tuple[int, bytes]:
    async with pool.request("POST", url, b"{}", {"Content-Type": "application/json"}) as response:
        return response.status, await response.read()


def test_streams_arrive_whole_and_reuse_one_connection(server: str) -> None:
    async def run() -> list[tuple[int, bytes]]:
        pool = connections()
        try:
            return [await body_of(pool, f"{server}/stream?n=20&gap=0.001") for _ in range(3)]
        finally:
            await pool.close()

    expected = b"".join(b"data: %d\n\n" % i for i in range(20))
    assert asyncio.run(run()) == [(200, expected)] * 3
    assert seen(server)["connections"] == 1


def test_an_error_answer_keeps_its_status_and_body(server: str) -> None:
    async def run() -> tuple[int, bytes]:
        pool = connections()
        try:
            return await body_of(pool, f"{server}/error")
        finally:
            await pool.close()

    status, body = asyncio.run(run())
    assert status == 404 and json.loads(body) == {"error": {"message": "no such model"}}


def test_a_stream_cut_mid_way_is_lost_and_the_next_one_gets_a_new_connection(server: str) -> None:
    async def run() -> tuple[list[bytes], Exception | None, tuple[int, bytes]]:
        pool = connections()
        got: list[bytes] = []
        try:
            try:
                async with pool.request("POST", f"{server}/cut?n=10&gap=0.01", b"{}") as response:
                    async for part in response.body():
                        got.append(part)
                failure = None
            except Lost as exc:
                failure = exc
            return got, failure, await body_of(pool, f"{server}/stream?n=2")
        finally:
            await pool.close()

    got, failure, after = asyncio.run(run())
    assert isinstance(failure, Lost)
    assert b"".join(got) == b"data: 0\n\ndata: 1\n\n"  # what came before the cut, and no end
    assert after == (200, b"data: 0\n\ndata: 1\n\n")
    assert seen(server)["connections"] == 2


def test_a_request_past_its_deadline_is_lost(server: str) -> None:
    async def run() -> float:
        pool = connections(timeout_s=0.5)
        started = time.monotonic()
        try:
            with pytest.raises(TimedOut, match="within 0.5 s"):
                await body_of(pool, f"{server}/stall")
            return time.monotonic() - started
        finally:
            await pool.close()

    assert asyncio.run(run()) < 10  # the deadline, not the server's hour, ended it


def test_a_kept_alive_connection_closed_under_a_request_sends_it_again_on_a_new_one(server: str) -> None:
    async def run() -> list[tuple[int, bytes]]:
        pool = connections()
        try:
            return [await body_of(pool, f"{server}/hang-up?id={k}") for k in range(2)]
        finally:
            await pool.close()

    assert asyncio.run(run()) == [(200, b"answered")] * 2
    assert seen(server) == {"connections": 2, "aborted": [], "hung_up": ["1"]}  # the second, once


def test_a_request_hung_up_on_is_sent_again_only_where_its_connection_was_kept_alive(server: str) -> None:
    """A new connection that ends unanswered is the engine's answer (it took the request and
    died, or refuses it): Lost, not sent again - also where it was itself the second try."""

    async def run() -> list[Exception]:
        pool = connections()
        failures = []
        try:
            for k in ("fresh", "kept"):
                with pytest.raises(Lost, match="connection closed") as failure:
                    await body_of(pool, f"{server}/hang-up?always=1&id={k}")
                failures.append(failure.value)
                await body_of(pool, f"{server}/stream?n=1")  # leaves a kept-alive connection
        finally:
            await pool.close()
        return failures

    assert not any(isinstance(f, TimedOut) for f in asyncio.run(run()))
    assert seen(server)["hung_up"] == ["fresh", "kept", "kept"]


def test_an_engine_url_other_than_http_is_refused_plainly() -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="http:// only"):
            await body_of(connections(), "https://127.0.0.1:8443/v1/chat/completions")

    asyncio.run(run())


def test_a_refused_connection_is_lost() -> None:
    async def run() -> None:
        pool = connections()
        with pytest.raises(Lost, match="cannot connect"):
            await body_of(pool, f"http://127.0.0.1:{free_port()}/stream")

    asyncio.run(run())


def test_a_reader_that_stops_early_closes_the_connection_and_the_server_sees_it(server: str) -> None:
    async def run() -> bytes:
        pool = connections()
        try:
            async with pool.request("POST", f"{server}/stream?n=5000&gap=0.01&id=early", b"{}") as response:
                async for part in response.body():
                    first = part
                    break
            # Still in the same event loop, which would keep a connection left open alive.
            deadline = time.monotonic() + 20
            while (await asyncio.to_thread(seen, server))["aborted"] != ["early"]:
                assert time.monotonic() < deadline, "the server went on streaming"
                await asyncio.sleep(0.05)
            return first
        finally:
            await pool.close()

    assert asyncio.run(run()).startswith(b"data: 0\n\n")


def test_an_idle_connection_past_its_keepalive_is_not_reused(server: str) -> None:
    async def run() -> None:
        pool = connections(keepalive_s=0.2)
        try:
            await body_of(pool, f"{server}/stream?n=1")
            await asyncio.sleep(0.4)
            await body_of(pool, f"{server}/stream?n=1")
        finally:
            await pool.close()

    asyncio.run(run())
    assert seen(server)["connections"] == 2


def test_stale_idle_connections_below_a_reused_one_are_closed(server: str) -> None:
    async def run() -> int:
        pool = connections(keepalive_s=1.0)
        try:
            await asyncio.gather(*(body_of(pool, f"{server}/stream?n=3&gap=0.05") for _ in range(3)))
            for _ in range(2):  # the newest is taken and kept fresh; the two below it go stale
                await asyncio.sleep(0.6)
                await body_of(pool, f"{server}/stream?n=1")
            return sum(len(idle) for idle in pool._idle.values())
        finally:
            await pool.close()

    assert asyncio.run(run()) == 1


def test_a_reader_that_falls_behind_pauses_the_server_and_still_gets_everything(server: str) -> None:
    async def run() -> bytes:
        pool = connections()
        got = []
        try:
            async with pool.request("POST", f"{server}/stream?n=3000", b"{}") as response:
                async for part in response.body():
                    got.append(part)
                    await asyncio.sleep(0.01)  # a slow reader: chunks pile up, reading the socket stops
            return b"".join(got)
        finally:
            await pool.close()

    assert asyncio.run(run()) == b"".join(b"data: %d\n\n" % i for i in range(3000))
