"""Prefill and decode on different GPU types and TP degrees: the GPU-free engines' hand-off.

Two engines serve Llama-3.1-8B, one as four H100s at TP4 and one as one L40 at TP1
(roofline profiles written here), each registered as ``both`` so that KV can go either
way. The decode engine learns its peer's profile in the side channel's handshake and
charges T_kv for the pair: min(TP) links share the bytes and the slower end bounds the
time (perfmodel.profile.t_kv). The KV itself moves as block contents and is checked
against the prompt, so a hand-off that moved the wrong blocks fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from perfmodel.catalog import GPUS, MODELS
from perfmodel.profile import Profile, t_kv
from perfmodel.roofline import roofline_profile
from tests.engines import Engine, start_sim_worker, stop
from tests.test_engine_protocol import handoff

SPEED = 0.1  # slow enough that T_kv dominates a pull's wall time, fast enough for CI
PULLS, PULL_SECONDS = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum"


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict[str, tuple[Engine, Profile]]]:
    tmp = tmp_path_factory.mktemp("mixed-tp")
    out: dict[str, tuple[Engine, Profile]] = {}
    try:
        for gpu, tp in (("H100", 4), ("L40", 1)):
            profile = roofline_profile(MODELS["llama-3.1-8b"], GPUS[gpu], tp)
            path = tmp / f"{profile.name}.json"
            profile.dump(path)
            engine = start_sim_worker(tmp, "--role", "both", "--profile", str(path), "--speed", str(SPEED))
            out[profile.name] = (engine, profile)
        yield out
    finally:
        for engine, _ in out.values():
            stop(engine)


@pytest.mark.parametrize(
    ("source", "target"),
    [("llama-3.1-8b_h100_tp4", "llama-3.1-8b_l40_tp1"), ("llama-3.1-8b_l40_tp1", "llama-3.1-8b_h100_tp4")],
)
def test_kv_moves_between_tp_degrees_and_costs_the_pairs_t_kv(engines, source, target):
    (prefill, src), (decode, dst) = engines[source], engines[target]
    # Unique and long (about 1,500 tokens), so that the pull is all new blocks and T_kv is
    # far above a pull's fixed costs.
    messages = [{"role": "user", "content": f"Case {uuid.uuid4().hex}. " + "Read the log line by line. " * 250}]
    before = decode.metrics()
    params, reply = handoff(prefill, decode, messages, 4)
    after = decode.metrics_once(lambda m: m[PULLS] > before[PULLS])
    assert after[PULLS] == before[PULLS] + 1
    assert after["vllm:nixl_num_failed_transfers_total"] == before["vllm:nixl_num_failed_transfers_total"]
    assert reply["usage"]["prompt_tokens"] == params["remote_num_tokens"] > 1000
    hits = "vllm:prefix_cache_hits_total"
    assert after[hits] == before[hits]  # nothing was local: it all came over

    # The pull took at least the pair's T_kv within one server (both engines run on this
    # host): the H100 side alone would move the same bytes over four NVLink links, many
    # times faster than the L40's PCIe.
    pulled = reply["usage"]["prompt_tokens"]  # every block, the last partial one included
    modelled = t_kv(pulled, src, dst, same_node=True) / SPEED
    h100 = engines["llama-3.1-8b_h100_tp4"][1]
    assert modelled > 2 * t_kv(pulled, h100, h100, same_node=True) / SPEED
    assert after[PULL_SECONDS] - before[PULL_SECONDS] >= modelled - 1e-3  # uvloop's clock ticks in milliseconds
