"""Bindings that outlive gateways and workers, static configuration, back-pressure, and a
round's reads of shared state."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis
import redis.asyncio as aioredis

from ampd.local_redis import free_port
from ampd.processes import spawn_gateway, wait_healthy
from gateway.metrics import GatewayMetrics
from gateway.state.failover import Failover
from gateway.state.leases import LEASE_S
from gateway.state.outage import REDIS_DOWN, RedisHealth
from gateway.state.prefill_queue import PrefillQueues
from gateway.state.redis_batch import RedisBatch
from gateway.state.replicas import ALIVE_S, RECONCILE_S
from gateway.state.round_reads import RoundReads
from gateway.state.sessions import Session, SessionStore, conversation_hashes, new_session
from gateway.state.stats import WindowedStats
from rounds.core import RoundCore, SessionState
from rounds.policies import POLICIES
from rounds.routing import PrefillTask
from tests.engines import start_gateway, start_sim_worker, stop
from tests.test_gateway import MODEL, REDIS_URL

BODY = {"model": MODEL, "max_tokens": 4}


def ask(url: str, session_id: str, content: str) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    response = httpx.post(f"{url}/v1/chat/completions", json={**BODY, "messages": messages}, timeout=60,
                          headers={"X-Session-Id": session_id})  # fmt: skip
    assert response.status_code == 200, response.text
    return response


def replica_queues(prefix: str, replica: str, client: aioredis.Redis, policy: str) -> PrefillQueues:
    """One replica's prefill queues, in this process, with one slot per worker."""
    metrics = GatewayMetrics(roles=list)
    health, batch = RedisHealth(metrics.redis_up, metrics.redis_errors), RedisBatch(client)
    failover = Failover(batch, health, metrics.redis_unreplicated, wait_s=0, ack_ms=0)  # a plain Redis: unused
    return PrefillQueues(client, batch, prefix, replica, RoundCore(POLICIES[policy]), slots=1, max_queue=8,
                         task_ttl_s=60, health=health, postponements=metrics.postponements,
                         failover=failover)  # fmt: skip


def cleanup(prefix: str) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=f"{prefix}:*"))
    if keys:
        r.delete(*keys)


def test_binding_survives_a_gateway_restart_and_moves_off_a_dead_worker(tmp_path):
    prefix = f"res-{uuid.uuid4().hex[:8]}"
    registry = ("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--speed", "20")
    decoders = [start_sim_worker(tmp_path, "--role", "decode", *registry) for _ in range(2)]
    gateway = start_gateway(tmp_path, REDIS_URL, prefix)
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        bound = ask(gateway.url, "s1", "first round").headers["x-ampd-route"].split(":", 1)[1]
        gateway.stop()
        gateway = start_gateway(tmp_path, REDIS_URL, prefix)  # a new process: only Redis remembers
        assert ask(gateway.url, "s1", "second round").headers["x-ampd-route"].split(":", 1)[1] == bound
        assert store.hget(f"{prefix}:session:public:s1", "rounds") == "2"

        victim = next(d for d in decoders if d.url.endswith(bound.rsplit(":", 1)[1]))
        stop(victim)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the pool drops it at its next failed scrape
            response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, headers={"X-Session-Id": "s1"},
                                  json={**BODY, "messages": [{"role": "user", "content": "third round"}]})  # fmt: skip
            if response.status_code == 200:
                break
            time.sleep(0.3)
        assert response.status_code == 200
        # The worker the round ran on. The gateway counts the GPU-free engine's prompts itself
        # (gateway.engines.tokens), so a worker that died since the last scrape is found when the
        # round's stream connects, and the round moves before its first token: X-AMPD-Route
        # names the worker as decided, X-AMPD-Decode-Worker the one that answered.
        moved = response.headers["x-ampd-decode-worker"]
        assert moved != bound
        record = store.hgetall(f"{prefix}:session:public:s1")
        assert record["decode_worker"] == moved and record["rounds"] == "3"
        # The new worker prefilled the whole history: what it holds is this round only.
        assert int(record["l_hist"]) == response.json()["usage"]["total_tokens"]
    finally:
        gateway.stop()
        for d in decoders:
            stop(d)
        cleanup(prefix)


def test_statically_configured_workers_need_no_registry(tmp_path):
    worker = start_sim_worker(tmp_path, "--role", "both", "--speed", "20")
    port = free_port()
    options = ["--redis-url", REDIS_URL, "--redis-prefix", f"static-{uuid.uuid4().hex[:6]}",
               "--worker", f"both={worker.url}@llama-3.1-8b_h100_tp1@20"]  # fmt: skip
    gateway = spawn_gateway("static", port, options, log=tmp_path / "static.log")
    try:
        assert wait_healthy([gateway], 30, path="/readyz") is None
        response = ask(gateway.url, "st", "hello")
        assert response.headers["x-ampd-route"] == f"local:{worker.url}"
        assert httpx.get(f"{gateway.url}/v1/models").json()["data"][0]["id"] == MODEL
    finally:
        gateway.stop()
        stop(worker)


def test_a_full_prefill_queue_answers_429(tmp_path):
    prefix = f"full-{uuid.uuid4().hex[:8]}"
    worker = start_sim_worker(tmp_path, "--role", "both", "--redis-url", REDIS_URL, "--redis-prefix", prefix)
    gateway = start_gateway(tmp_path, REDIS_URL, prefix, "--max-queue", "1")
    long_prompt = "many words in this prompt " * 3000  # ~15k tokens: a slow prefill at speed 1

    def one(i: int) -> httpx.Response:
        return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120,
                          json={**BODY, "messages": [{"role": "user", "content": f"{i} {long_prompt}"}]})  # fmt: skip

    try:
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(one, range(6)))
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 429 in statuses, statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.json()["error"]["code"] == "queue_full" and refused.headers["retry-after"] == "1"
    finally:
        gateway.stop()
        stop(worker)
        cleanup(prefix)


def test_a_dispatch_notice_lost_while_unsubscribed_does_not_strand_its_task():
    """Replica B dispatches replica A's queued task while A's notice subscription is
    down (Redis dropped it): the notice is lost, and A still starts the task because it
    looks its waiting tasks up now and then (gateway.state.replicas.Replicas.reconcile)."""

    prefix = f"notice-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        a, b = (replica_queues(prefix, n, client, "ampd") for n in "ab")
        await a.start()
        await b.start()
        try:
            now = time.time()
            held = await b.submit("w", PrefillTask("t1", 0, 100, now), 0.1, 5.0)  # takes the one slot
            waiting = asyncio.create_task(a.submit("w", PrefillTask("t2", 0, 100, now), 0.1, 5.0))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")  # A hears nothing for a moment
            await b.finish("w", held.task_id)  # dispatches t2 and publishes to nobody
            dispatched = await asyncio.wait_for(waiting, timeout=3 * RECONCILE_S)
            assert dispatched.task_id == "t2" and dispatched.worker_id == "w"
        finally:
            await a.stop()
            await b.stop()
            await client.aclose()
            cleanup(prefix)

    asyncio.run(scenario())


def test_queued_tasks_of_a_dead_replica_do_not_hold_the_slot():
    """Replica A dies with two tasks queued behind B's running one. When B's task ends,
    A's tasks (nobody waits for them) are dropped, not dispatched: B's next queued task
    gets the slot at once instead of after A's tasks' leases lapse."""

    prefix = f"orphans-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        a, b = (replica_queues(prefix, n, client, "disagg") for n in "ab")
        await a.start()
        await b.start()
        now = time.time()
        held = await b.submit("w", PrefillTask("t1", 0, 100, now), 0.1, 5.0)
        orphans = [asyncio.create_task(a.submit("w", PrefillTask(t, 0, 100, now), 0.1, 5.0)) for t in ("t2", "t3")]
        await asyncio.sleep(0.3)
        await a.stop()  # A dies: no more liveness, nobody listening for its tasks
        await asyncio.sleep(ALIVE_S + 0.5)
        try:
            mine = asyncio.create_task(b.submit("w", PrefillTask("t4", 0, 100, now), 0.1, 5.0))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await b.finish("w", held.task_id)
            dispatched = await asyncio.wait_for(mine, timeout=LEASE_S)
            assert dispatched.task_id == "t4" and time.monotonic() - started < 2.0
            assert await client.llen(f"{prefix}:pq:w") == 0
        finally:
            for task in orphans:
                task.cancel()
            await asyncio.gather(*orphans, return_exceptions=True)
            await b.stop()
            await client.aclose()
            cleanup(prefix)

    asyncio.run(scenario())


def test_a_round_reads_its_session_and_signals_in_one_round_trip_and_falls_back_on_its_copy():
    """A client's round reads its session (inferred from its conversation, or by the id it
    gave), the session's transcript and the workers' load signals in one Redis command
    (gateway.state.scripts.OPEN), seen with MONITOR; the session is saved, and a prefill's slot
    freed, in one command each. Where Redis lost them (restarted empty), or cannot be
    reached, the replica's own copy of what it wrote last answers instead."""

    prefix = f"open-{uuid.uuid4().hex[:8]}"
    said = [{"role": "user", "content": "find the flights"}, {"role": "assistant", "content": "which day?"}]
    transcript = [said[0], {"role": "assistant", "content": "(searched)"}, said[1]]
    asked = conversation_hashes("public", [*said, {"role": "user", "content": "monday"}])

    def stores(client: aioredis.Redis) -> tuple[SessionStore, RoundReads]:
        metrics = GatewayMetrics(roles=list)
        health = RedisHealth(metrics.redis_up, metrics.redis_errors)
        sessions = SessionStore(client, prefix, 60, health)
        queues = replica_queues(prefix, "a", client, "ampd")
        return sessions, RoundReads(queues.batch, sessions, queues, WindowedStats(prefix, 10), health)

    async def save(sessions: SessionStore, client: aioredis.Redis, session: Session) -> None:
        pipe = client.pipeline(transaction=False)
        sessions.save(pipe, session, said, conversation_hashes("public", said)[-1], transcript)
        with contextlib.suppress(*REDIS_DOWN):
            await pipe.execute()

    async def commands_of(client: aioredis.Redis, read) -> list[str]:
        """The commands this test's client sent while ``read`` ran (not those its scripts ran)."""
        monitor = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        async with monitor.monitor() as m:
            await read()
            await client.echo(f"{prefix}-done")
            sent = []
            while True:
                command = await asyncio.wait_for(m.next_command(), timeout=10)
                if command["command"] == f"ECHO {prefix}-done":
                    break
                if command["client_type"] != "lua" and prefix in command["command"]:
                    sent.append(command["command"].split()[0])
        await monitor.aclose()
        return sent

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        sessions, reads = stores(client)
        session = new_session("s1", "public", SessionState("w1", l_hist=57, rounds=1), explicit_id=False)
        try:
            await save(sessions, client, session)
            await client.set(f"{prefix}:pqcost:w1", "0.25")
            await client.zadd(f"{prefix}:inflight:w1", {"t1": time.time() + 60})
            await client.hset(f"{prefix}:task:t1", "tokens", "300")
            opened = await reads.read("public", None, asked, ["w1", "w2"])
            assert opened.session == session and opened.transcript == transcript
            assert opened.signals.queue_costs == {"w1": 0.25, "w2": 0.0}
            assert opened.signals.active_tokens == {"w1": 300, "w2": 0}
            by_id = await reads.read("public", "s1", asked, ["w1"])
            assert by_id.session == session and by_id.transcript == transcript
            nobody = await reads.read("public", None, conversation_hashes("public", said[:1]), ["w1"])
            assert nobody.session is None and nobody.transcript is None

            sent = await commands_of(client, lambda: reads.read("public", None, asked, ["w1", "w2"]))
            assert sent == ["EVALSHA"], sent
            # The exchange's session is saved in one command, and a prefill's slot freed in one.
            assert await commands_of(client, lambda: save(sessions, client, session)) == ["EVAL"]
            sent = await commands_of(client, lambda: reads.queues.leases.free("w1", "t1"))
            assert sent == ["EVALSHA"], sent
            assert await client.zscore(f"{prefix}:inflight:w1", "t1") is None
            assert not await client.exists(f"{prefix}:task:t1")

            cleanup(prefix)  # Redis restarted empty: this replica's copy answers
            assert (await reads.read("public", None, asked, ["w1"])).session == session
            restarted = await reads.read("public", "s1", asked, ["w1"])
            assert restarted.session == session and restarted.transcript == transcript
            assert restarted.signals.queue_costs == {"w1": 0.0}
        finally:
            await client.aclose()
            cleanup(prefix)

        away = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", decode_responses=True)
        sessions, reads = stores(away)
        await save(sessions, away, session)
        opened = await reads.read("public", None, asked, ["w1"])
        assert opened.session == session and opened.transcript == transcript
        assert opened.signals.queue_costs == {"w1": 0.0} and opened.signals.means == {}
        await away.aclose()

    asyncio.run(scenario())


def test_windowed_means_in_redis_are_running_sums_that_match_the_simulators():
    """The windowed TTFT/ITL means every round reads (gateway.state.scripts: ``_WINDOW``): random
    observations and reads in time order give the simulator's in-memory means (rounds.windowed.
    WindowedMeans) to 1e-9; a read costs Redis one hash read per (series, worker) whatever
    the window's length (seen with MONITOR); an observation older than the window a reader
    moved to is dropped; a window left idle empties and its key goes away."""
    from gateway.state import scripts
    from rounds.core import ITL, TTFT_REMOTE, Observation
    from rounds.windowed import WindowedMeans

    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    rng = random.Random(7)
    start = 1_800_000_000.0

    def read(stats: WindowedStats, wanted: list[tuple[str, str]], now: float) -> dict[tuple[str, str], float]:
        flat = client.eval(scripts.SIGNALS, 0, "none", now, 0, *stats.means_args(wanted, now))
        return stats.parse_means(wanted, flat)

    def observe(stats: WindowedStats, observations: list[Observation], now: float) -> None:
        pipe = client.pipeline(transaction=False)
        stats.record(pipe, observations, now)
        pipe.execute()

    for window in (3, 10):
        prefix = f"window-{window}-{uuid.uuid4().hex[:8]}"
        stats, memory = WindowedStats(prefix, window), WindowedMeans(window)
        wanted = [(TTFT_REMOTE, "p1"), (TTFT_REMOTE, "p2"), (ITL, "d1")]
        try:
            now = start
            for _ in range(400):
                now += rng.choice([0.05, 0.3, 0.9, 2.5, window * 0.7, window + 3.0])
                if rng.random() < 0.6:
                    series, worker = rng.choice(wanted)
                    o = Observation(series, worker, rng.uniform(0.001, 2.0), rng.randint(1, 40))
                    observe(stats, [o], now)
                    memory.record(o, now)
                got = read(stats, wanted, now)
                expected = {k: v for k in wanted if (v := memory.mean(*k, now)) is not None}
                assert got.keys() == expected.keys(), (now - start, got, expected)
                for k, v in expected.items():
                    assert abs(got[k] - v) <= 1e-9 * v, (k, got[k], v)
            assert all(0 < client.ttl(k) <= window + 2 for k in client.scan_iter(match=f"{prefix}:*"))

            # One HMGET per mean once the window has moved on this second, however long it is.
            read(stats, wanted, now)
            with client.monitor() as m:
                read(stats, wanted, now)
                client.echo(f"{prefix}-done")
                commands = []
                for command in m.listen():
                    if command["command"] == f"ECHO {prefix}-done":
                        break
                    # MONITOR sees the whole server: other tests' scripts run beside this one.
                    if command["client_type"] == "lua" and f"{prefix}:" in command["command"]:
                        commands.append(command["command"].split()[0])
            assert commands == ["HMGET"] * len(wanted), commands

            # A replica whose clock lags a window behind the readers: its observation is dropped.
            lagging = Observation(ITL, "d1", 100.0, 1)
            before = read(stats, wanted, now).get((ITL, "d1"))
            observe(stats, [lagging], now - window - 1)
            assert read(stats, wanted, now).get((ITL, "d1")) == before

            # Idle past the window: empty, and the keys are gone.
            assert read(stats, wanted, now + window + 1) == {}
            assert list(client.scan_iter(match=f"{prefix}:*")) == []
        finally:
            cleanup(prefix)
    client.close()
