"""vLLM's wire surface, as ampd uses it: one module for the gateway, both workers and the profiler.

What crosses HTTP between a gateway and its engines, following vLLM 0.32's
NixlConnector and its Prometheus exposition:

* the connector every engine runs (``kv_transfer_config``): ``kv_both``, so a role is
  only the gateway's decision of what to send where;
* the two halves of a disaggregated hand-off in ``kv_transfer_params``: what the
  gateway sends a prefill engine (``prefill_params``) and what that engine answers for
  the decode engine to pull (``pull_params``, ``PULL_FIELDS``);
* the ``/metrics`` series routing, the supervisor and the profiler read, and their parsers
  (a line scan for the hot scrape, prometheus-client's parser elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

KVBufferDevice = Literal["cuda", "cpu"]

# -- the connector ----------------------------------------------------------------------


def kv_transfer_config(kv_buffer_device: KVBufferDevice, connector_module: str | None = None) -> dict[str, str]:
    """vLLM's ``--kv-transfer-config``. A KV pull that fails (a handshake timing out, the
    prefill engine gone) recomputes the missing blocks instead of failing the round.
    ``connector_module``: where vLLM loads ``NixlConnector`` from instead of its own
    (``kv_connector_module_path``; ampd's, workers.vllm.connector, runs split requests).
    The class keeps vLLM's name, which vLLM's configuration checks connectors by."""
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": kv_buffer_device,
        "kv_load_failure_policy": "recompute",
    }
    return config if connector_module is None else {**config, "kv_connector_module_path": connector_module}


# -- kv_transfer_params -------------------------------------------------------------------

# The prefill half, as vLLM's disaggregation proxy sends it (with ``max_tokens: 1``).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# ampd's extension: prefill and hold only the prompt's first ``split_at`` tokens - a split
# request's first part (rounds.split_point). The answer's ``remote_num_tokens`` says how
# many; a decode engine pulls those and prefills the rest. The GPU-free engine runs it
# itself; vLLM 0.32 through ampd's connector (workers.vllm.connector), whose prefill side
# cuts the prompt and whose decode side caps the pull at remote_num_tokens - vLLM's own
# NixlConnector pulls KV for the whole prompt, ignoring remote_num_tokens.
SPLIT_AT = "split_at"


def prefill_params(split_at: int | None = None) -> dict[str, Any]:
    """What the gateway sends a prefill engine: vLLM's, plus a split point if any."""
    return PREFILL_PARAMS if split_at is None else {**PREFILL_PARAMS, SPLIT_AT: split_at}


# What a decode engine needs to pull a prefill's KV.
PULL_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids")


def pull_params(
    engine_id: str, request_id: str, host: str, port: int, block_ids: list[int], num_tokens: int, tp_size: int
) -> dict[str, Any]:
    """The prefill engine's answer: where the decode engine pulls the held blocks from
    (one block list per KV-cache group, as vLLM >= 0.12 sends them)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }


# -- /metrics -------------------------------------------------------------------------------

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
CACHE_CONFIG = "vllm:cache_config_info"
NIXL_TRANSFER_TIME = "vllm:nixl_xfer_time_seconds"
# Prompt tokens by where their KV came from (vLLM's PromptTokenStats): the sample's name,
# and its ``source`` labels. ``local_compute`` is the prefill an engine really computed.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Not vLLM's: how late the GPU-free engine's steps end against their modelled deadline.
STEP_LATENESS = "ampd:sim_step_lateness_seconds"


@dataclass(frozen=True)
class WorkerLoad:
    kv_usage: float
    running: int
    waiting: int


def parse_load(exposition: str) -> WorkerLoad:
    """The three gauges routing needs from a /metrics page, summed over label sets.

    A line scan, not a full exposition parser: a scrape page holds hundreds of samples
    and every gateway replica reads every worker's page every second.
    """
    values = dict.fromkeys((KV_USAGE, RUNNING, WAITING), 0.0)
    for line in exposition.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return WorkerLoad(kv_usage=values[KV_USAGE], running=int(values[RUNNING]), waiting=int(values[WAITING]))


def source_totals(exposition: str) -> dict[str, float]:
    """:data:`PROMPT_TOKENS_BY_SOURCE` by its ``source`` label, summed over the others."""
    out = dict.fromkeys(PROMPT_SOURCES, 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == PROMPT_TOKENS_BY_SOURCE and sample.labels.get("source") in out:
                out[sample.labels["source"]] += sample.value
    return out


def bucket_totals(exposition: str, histogram: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (``le``), summed over labels."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == f"{histogram}_bucket":
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket that holds quantile ``q`` of cumulative ``buckets`` (as
    coarse as the buckets; ``inf`` past the last bound); None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    wanted = q * buckets[bounds[-1]]
    return next(le for le in bounds if buckets[le] >= wanted)


def metric_totals(exposition: str) -> dict[str, float]:
    """Every sample of a /metrics page by name (``_total``, ``_sum``, ... included), summed over labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def cache_config(exposition: str) -> tuple[int, int] | None:
    """(KV blocks, block size) from the ``vllm:cache_config_info`` labels, if exported."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.startswith(CACHE_CONFIG):
                blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks not in (None, "", "None") and size not in (None, "", "None"):
                    return int(blocks), int(size)
    return None
