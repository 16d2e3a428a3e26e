"""One gateway replica wired from its configuration: the collaborators the coordinator holds."""

from __future__ import annotations

import random

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo

from gateway.config import GatewayConfig
from gateway.coordinator import Gateway
from gateway.elastic_live import ElasticLoop
from gateway.engines.kv_index import KVIndex
from gateway.engines.kv_subscriber import KVSubscriber
from gateway.engines.pool import WorkerPool
from gateway.engines.step_targets import StepTargets
from gateway.engines.tokens import ServedTokenizers
from gateway.engines.upstream import EngineClient
from gateway.metrics import GatewayMetrics
from gateway.rounds import RoundRecorder, RoundRunner
from gateway.state.failover import Failover
from gateway.state.outage import RedisHealth
from gateway.state.prefill_queue import PrefillQueues
from gateway.state.redis_batch import PackedConnection, RedisBatch
from gateway.state.round_reads import RoundReads
from gateway.state.sessions import SessionStore
from gateway.state.stats import WindowedStats
from gateway.tenancy import Keyring
from gateway.tracing import RoundTracer
from rounds.core import RoundCore
from rounds.policies import POLICIES
from surface.redis_address import RedisAddress
from tools_sandbox.client import ToolRunner

REDIS_CONNECTIONS = 256


def assemble(config: GatewayConfig) -> Gateway:
    """The gateway a replica runs: its Redis client, engine client, metrics, worker pool,
    prefill queues, session store, statistics, round runner and, for an elastic policy,
    the role controller - each given what it shares with the others."""
    address = RedisAddress.parse(config.redis_url)
    redis = redis_client(address)
    batch = RedisBatch(redis)
    client = EngineClient(config.request_timeout_s)
    policy = POLICIES[config.policy]
    core = RoundCore(policy, config.alpha, config.beta, config.reorder_window, random.Random(config.routing_seed),
                     config.itl_slo_metric, config.placement)  # fmt: skip
    index = KVIndex()
    metrics = GatewayMetrics(roles=lambda: pool.role_list(), indexed=lambda: index.held_blocks())
    health = RedisHealth(metrics.redis_up, metrics.redis_errors)
    failover = Failover(batch, health, metrics.redis_unreplicated, config.redis_failover_wait_s,
                        config.redis_replica_ack_ms)  # fmt: skip
    queues = PrefillQueues(
        redis, batch, config.key_prefix, config.replica_id, core, slots=config.prefill_slots,
        max_queue=config.max_queue, task_ttl_s=config.session_ttl_s, health=health, postponements=metrics.postponements,
        failover=failover, ledger=config.kv_index,
    )  # fmt: skip
    pool = WorkerPool(redis, config.key_prefix, config.static_workers, client, health)
    stats = WindowedStats(config.key_prefix, config.stats_window_s)
    sessions = SessionStore(redis, config.key_prefix, config.session_ttl_s, health)
    elastic = None
    if policy.elastic is not None:
        elastic = ElasticLoop(
            policy.elastic, pool, queues, stats, redis, config.key_prefix, config.replica_id, metrics,
            config.alpha, config.beta, config.role_plan,
        )  # fmt: skip
    recorder = RoundRecorder(core, redis, batch, failover, stats, sessions, RoundTracer(), metrics, health,
                             elastic.demand if elastic else None)  # fmt: skip
    return Gateway(
        config=config, redis=redis, batch=batch, client=client, metrics=metrics, health=health, pool=pool,
        queues=queues, sessions=sessions, reads=RoundReads(batch, sessions, queues, stats, health),
        tokenizers=ServedTokenizers(redis, config.key_prefix, client, metrics.prompt_count_checks),
        rounds=RoundRunner(core, pool, queues, client, metrics, config.migration_limit, recorder),
        tools=ToolRunner(address.client(), config.key_prefix), step_targets=StepTargets(redis, config),
        keys=Keyring(config.api_keys, config.api_keys_file),
        kv=KVSubscriber(index, metrics.kv_malformed, metrics.kv_dropped), failover=failover, elastic=elastic,
    )  # fmt: skip


def redis_client(address: RedisAddress) -> aioredis.Redis:
    """The replica's Redis client. It blocks for a free connection rather than fail when
    hundreds of requests are in flight. A connection Redis dropped (a restart) fails on
    first use: it is opened again and the command sent once more - a write on a dead socket
    never reached Redis, so the retry cannot apply it twice. (With a pool of its own,
    redis-py retries nothing.) The client's name and version (CLIENT SETINFO) are read
    once: left to redis-py, each new connection parses the package's metadata again, paid
    for every connection a burst of streams opens."""
    client = address.async_client(
        blocking=True, decode_responses=True, max_connections=REDIS_CONNECTIONS, timeout=10,
        retry=Retry(NoBackoff(), 1), retry_on_error=[aioredis.ConnectionError], driver_info=DriverInfo(),
    )  # fmt: skip
    pool = client.connection_pool
    if pool.connection_class is aioredis.Connection:  # TCP (TLS, unix sockets and Sentinel's pack as redis-py does)
        pool.connection_class = PackedConnection
    return client
