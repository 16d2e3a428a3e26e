"""The gateway's own Prometheus metrics (per round, as the gateway measures them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from perfmodel.slo import ITL_RULES

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class _Postponements(Collector):
    """Read at scrape time from the prefill queues, which count them as they decide."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count = count

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "ampd_reorder_postponements", "Tasks postponed by prefill reordering (Alg. 2).", value=self.count()
        )


class GatewayMetrics:
    def __init__(self, postponements: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_Postponements(postponements))
        self.ttft = Histogram(
            "ampd_ttft_seconds", "Time to first token of a round.", ["kind"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "ampd_itl_seconds", "Mean inter-token latency of a round.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.routes = Counter("ampd_route", "Prefill routing decisions.", ["route", "reason"], registry=r)
        self.slo_rounds = Counter(
            "ampd_slo_rounds", "Rounds that met or missed their SLO, by ITL rule (mean, p95 or max gap).",
            ["rule", "outcome"], registry=r,
        )  # fmt: skip
        for rule in ITL_RULES:
            for outcome in ("met", "missed"):
                self.slo_rounds.labels(rule, outcome)
        self.queue_wait = Histogram(
            "ampd_prefill_queue_wait_seconds",
            "Time a prefill task waited in its queue.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("ampd_requests", "Chat completion requests by outcome.", ["status"], registry=r)
        self.tool_seconds = Histogram(
            "ampd_tool_seconds", "Server-side tool call duration, queueing included.", ["tool"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "ampd_migrations", "Streams that lost their decode worker: moved on, or refused past the limit.",
            ["outcome"], registry=r,
        )  # fmt: skip
        for outcome in ("moved", "refused"):
            self.migrations.labels(outcome)
        self.redis_up = Gauge("ampd_redis_up", "1 while Redis answers this replica, 0 during an outage.", registry=r)
        self.redis_errors = Counter(
            "ampd_redis_errors", "Redis calls that failed, by what the gateway was doing (gateway.outage).", ["what"],
            registry=r,
        )  # fmt: skip
        self.sessions = Counter("ampd_sessions_bound", "New sessions bound to a decode worker.", registry=r)
        self.worker_role = Gauge(
            "ampd_worker_role", "1 for each engine's role: prefill, decode, mixed, or both (never assigned one).",
            ["worker", "role"], registry=r,
        )  # fmt: skip
        self.role_moves = Counter(
            "ampd_role_moves", "Engines the elastic controller moved to another role, by why.", ["reason"], registry=r
        )
        self.sessions_active = Gauge(
            "ampd_sessions_active", "Sessions with an exchange in the last 5 minutes, all replicas.", registry=r
        )
        self.decision = Histogram(
            "ampd_routing_decision_seconds",
            "Time the routing policy itself took (no I/O).",
            buckets=(1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3),
            registry=r,
        )
