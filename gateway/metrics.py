"""The gateway's own Prometheus metrics (per round, as the gateway measures them).

One gateway may be several processes sharing a port (``ampd gateway --processes``):
then ``PROMETHEUS_MULTIPROC_DIR`` is set before they start, prometheus-client keeps
every process's values in files there, and a scrape - answered by whichever process
takes it - adds them up (counters, histograms) or combines them by each gauge's
``multiprocess_mode``. What every process knows alike (the engines' roles) is read at
scrape time instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from perfmodel.slo import ITL_RULES

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own variable


class _Roles(Collector):
    """Each engine's role, from the worker pool as the scraped process sees it."""

    def __init__(self, roles: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self.roles = roles

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "ampd_worker_role", "1 for each engine's role: prefill, decode, mixed, or both (never assigned one).",
            labels=["worker", "role"],
        )  # fmt: skip
        for worker, role in self.roles():
            family.add_metric([worker, role], 1)
        yield family


class _IndexedBlocks(Collector):
    """The blocks the replica's KV index holds per engine (gateway.engines.kv_index), read
    at scrape time."""

    def __init__(self, indexed: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self.indexed = indexed

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "ampd_kv_indexed_blocks", "Prefix blocks each engine holds, as this replica's KV index sees them.",
            labels=["worker"],
        )  # fmt: skip
        for worker, blocks in self.indexed():
            family.add_metric([worker], blocks)
        yield family


class Family:
    """A labelled metric and its children, each child made once. prometheus-client's
    ``labels()`` checks, converts and locks on every call - eight Python calls - and a round
    takes six children; here a child is a dict lookup once it exists."""

    def __init__(self, metric: Counter | Histogram) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Counter | Histogram] = {}

    def labels(self, *values: str) -> Counter | Histogram:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class GatewayMetrics:
    """``roles``: (worker, role) of every engine in the pool, and ``indexed``: (worker,
    blocks) of every engine the KV index follows, both read at each scrape."""

    def __init__(
        self,
        roles: Callable[[], Iterable[tuple[str, str]]],
        indexed: Callable[[], Iterable[tuple[str, int]]] = tuple,
    ) -> None:
        r = CollectorRegistry()
        self.postponements = Counter(
            "ampd_reorder_postponements", "Tasks postponed by prefill reordering (Alg. 2).", registry=r
        )
        self.ttft = Family(Histogram(
            "ampd_ttft_seconds", "Time to first token of a round.", ["kind"], buckets=LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.itl = Histogram(
            "ampd_itl_seconds", "Mean inter-token latency of a round.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.routes = Family(Counter("ampd_route", "Prefill routing decisions.", ["route", "reason"], registry=r))
        self.slo_rounds = Family(Counter(
            "ampd_slo_rounds", "Rounds that met or missed their SLO, by ITL rule (mean, p95 or max gap).",
            ["rule", "outcome"], registry=r,
        ))  # fmt: skip
        for rule in ITL_RULES:
            for outcome in ("met", "missed"):
                self.slo_rounds.labels(rule, outcome)
        self.queue_wait = Histogram(
            "ampd_prefill_queue_wait_seconds",
            "Time a prefill task waited in its queue.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Family(Counter("ampd_requests", "Chat completion requests by outcome.", ["status"], registry=r))
        self.prompt_count_checks = Family(Counter(
            "ampd_prompt_count_checks", "The gateway's prompt counts, checked against the engines'.",
            ["result"], registry=r,
        ))  # fmt: skip
        for result in ("equal", "differs"):
            self.prompt_count_checks.labels(result)
        self.tool_seconds = Family(Histogram(
            "ampd_tool_seconds", "Server-side tool call duration, queueing included.", ["tool"],
            buckets=LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.migrations = Family(Counter(
            "ampd_migrations", "Streams that lost their decode worker: moved on, or refused past the limit.",
            ["outcome"], registry=r,
        ))  # fmt: skip
        for outcome in ("moved", "refused"):
            self.migrations.labels(outcome)
        self.redis_up = Gauge(  # any process of a replica that Redis fails says so
            "ampd_redis_up", "1 while Redis answers this replica, 0 during an outage.", registry=r,
            multiprocess_mode="livemin",
        )  # fmt: skip
        self.redis_errors = Family(Counter(
            "ampd_redis_errors", "Redis calls that failed, by what the gateway was doing (gateway.state.outage).",
            ["what"], registry=r,
        ))  # fmt: skip
        self.redis_unreplicated = Counter(
            "ampd_redis_unreplicated_writes", "Rounds whose writes a Sentinel-managed primary took with no "
            "replica's acknowledgement: a failover could lose them (gateway.state.failover).", registry=r,
        )  # fmt: skip
        self.sessions = Counter("ampd_sessions_bound", "New sessions bound to a decode worker.", registry=r)
        self.role_moves = Family(Counter(
            "ampd_role_moves", "Engines the elastic controller moved to another role, by why.", ["reason"], registry=r,
        ))  # fmt: skip
        self.sessions_active = Gauge(  # set by the process a scrape reaches, just before it answers
            "ampd_sessions_active", "Sessions with an exchange in the last 5 minutes, all replicas.", registry=r,
            multiprocess_mode="livemostrecent",
        )  # fmt: skip
        self.decision = Histogram(
            "ampd_routing_decision_seconds",
            "Time the routing policy itself took (no I/O).",
            buckets=(1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3),
            registry=r,
        )
        self.kv_malformed = Counter(
            "ampd_kv_events_malformed", "KV event frames from engines that did not decode, skipped.", registry=r
        )
        self.kv_dropped = Family(Counter(
            "ampd_kv_index_dropped", "Engines' views in the KV index dropped and rebuilt: gap, restart, bound, silent.",
            ["reason"], registry=r,
        ))  # fmt: skip
        for reason in ("gap", "restart", "bound", "silent"):
            self.kv_dropped.labels(reason)
        if os.environ.get(MULTIPROCESS_DIR):
            self._exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._exposed)
        else:
            self._exposed = r
        self._exposed.register(_Roles(roles))
        self._exposed.register(_IndexedBlocks(indexed))

    def exposition(self) -> bytes:
        """The text a scrape gets: this process's metrics, or every process's of its replica."""
        return generate_latest(self._exposed)

    @staticmethod
    def process_exits() -> None:
        """A process of several leaves: its live-only gauges stop counting (``livemin``...)."""
        if os.environ.get(MULTIPROCESS_DIR):
            multiprocess.mark_process_dead(os.getpid())
