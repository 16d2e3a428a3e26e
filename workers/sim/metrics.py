"""vLLM's Prometheus metrics, by name, labels and buckets (vllm/v1/metrics/loggers.py, 0.32).

Gauges and counters that are scheduler state (running, waiting, KV usage, prefix-cache
queries and hits, preemptions) are read from the scheduler at scrape time, so there
is one source of truth; latencies are observed by the engine as they happen.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rounds.engine.scheduler import Scheduler
from surface import wire

LABELS = ("model_name", "engine")


def _buckets(spaced: str) -> tuple[float, ...]:
    return tuple(float(x) for x in spaced.split())


TTFT_BUCKETS = _buckets("0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10 20 40 80 160 640 2560")
ITL_BUCKETS = _buckets("0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1 2.5 5 7.5 10 20 40 80")
REQUEST_LATENCY_BUCKETS = _buckets("0.3 0.5 0.8 1 1.5 2 2.5 5 10 15 20 30 40 50 60 120 240 480 960 1920 7680")
NIXL_XFER_BUCKETS = _buckets("0.005 0.01 0.025 0.05 0.075 0.1 0.2 0.3 0.5 0.75 1 5")
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
NIXL_DESCRIPTOR_BUCKETS = _buckets("10 20 30 50 75 100 200 400 1000 2000 4000 10000 20000 50000")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def _one_two_five(limit: int) -> list[float]:
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


class _SchedulerState(Collector):
    def __init__(self, scheduler: Scheduler, labels: tuple[str, str]) -> None:
        self.scheduler, self.labels = scheduler, list(labels)

    def collect(self) -> Iterator[Metric]:
        s = self.scheduler
        values = [
            (
                GaugeMetricFamily,
                wire.RUNNING,
                "Number of requests in model execution batches.",
                len(s.running),
            ),
            (
                GaugeMetricFamily,
                wire.WAITING,
                "Number of requests waiting to be processed.",
                len(s.waiting),
            ),
            (GaugeMetricFamily, wire.KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", s.kv.usage),
            (
                GaugeMetricFamily,
                "ampd:step_target_seconds",
                "The step time this engine keeps to while requests decode; 0 = off.",
                s.config.step_target_s,
            ),
            (
                CounterMetricFamily,
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.kv.stats.queries,
            ),
            (
                CounterMetricFamily,
                wire.PREFIX_CACHE_HITS,
                "Prefix cache hits, in terms of number of cached tokens.",
                s.kv.stats.hits,
            ),
            (
                CounterMetricFamily,
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                s.num_preemptions,
            ),
            (
                CounterMetricFamily,
                "vllm:nixl_num_kv_expired_reqs",
                "Number of requests whose KV blocks expired before being read.",
                s.num_expired_holds,
            ),
        ]
        for family, name, doc, value in values:
            metric = family(name, doc, labels=list(LABELS))
            metric.add_metric(self.labels, value)
            yield metric
        # vLLM exports its CacheConfig as labels of a constant gauge; profilers read the KV capacity here.
        config = {"block_size": s.kv.block_size, "num_gpu_blocks": s.kv.num_blocks,
                  "enable_prefix_caching": s.kv.enable_prefix_caching}  # fmt: skip
        info = GaugeMetricFamily(wire.CACHE_CONFIG, "Information of the LLMEngine CacheConfig", labels=list(config))
        info.add_metric([str(v) for v in config.values()], 1.0)
        yield info


class EngineMetrics:
    """One registry per engine, so several engines can live in one test process."""

    def __init__(self, scheduler: Scheduler, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        labels = (model_name, "0")
        self.registry.register(_SchedulerState(scheduler, labels))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry).labels(*labels)

        token_buckets = _one_two_five(max_model_len)
        self.ttft = histogram(wire.TTFT, "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram(wire.ITL, "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter(wire.PROMPT_TOKENS_BY_SOURCE.removesuffix("_total"), "Number of prompt tokens by source.",
                            [*LABELS, "source"], registry=self.registry)  # fmt: skip
        self.prompt_tokens_by_source = {source: by_source.labels(*labels, source) for source in wire.PROMPT_SOURCES}
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.nixl_xfer_time = histogram(
            wire.NIXL_TRANSFER_TIME,
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            NIXL_XFER_BUCKETS,
        )
        self.nixl_bytes = histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            NIXL_BYTES_BUCKETS,
        )
        self.nixl_descriptors = histogram(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL KV Cache transfers.",
            NIXL_DESCRIPTOR_BUCKETS,
        )
        self.nixl_failed = counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.")
        # Not a vLLM metric: how late the sim's steps end against their modelled deadline.
        self.step_lateness = histogram(
            wire.STEP_LATENESS,
            "How much later than modelled a simulated engine step ended (wall clock).",
            (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            LABELS + ("finished_reason",),
            registry=self.registry,
        )
        self.request_success = {reason: success.labels(*labels, reason) for reason in FINISHED_REASONS}
