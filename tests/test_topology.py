"""The model's topology: servers of GPUs joined by NVLink, NICs between them. T_kv takes
the path by where the engines sit, the planner places engines on servers, and routing
prices a remote prefill by its path."""

from __future__ import annotations

import pytest

from perfmodel.catalog import GPUS, MODELS
from perfmodel.profile import t_kv
from perfmodel.roofline import roofline_profile
from perfmodel.slo import SLO
from planner.placement import Engine, place
from planner.simulator import Pool, SimConfig, Simulation
from planner.trace import TraceRound, TraceSession
from rounds.routing import PrefillTask, WorkerView, remote_work

pytestmark = pytest.mark.unit

TP2 = roofline_profile(MODELS["llama-3.1-70b"], GPUS["H20"], 2)
TP4 = roofline_profile(MODELS["llama-3.1-70b"], GPUS["H20"], 4)


def test_within_a_server_kv_moves_over_nvlink_and_between_servers_over_the_nic():
    inside, across = t_kv(4096, TP2, TP4, same_node=True), t_kv(4096, TP2, TP4)
    h20 = GPUS["H20"]
    assert h20.intra_node_bandwidth > 2 * h20.network_bandwidth
    # The bytes' part scales with the links' bandwidths; the fixed latency is the same.
    latency = TP2.efficiency.kv_transfer_latency_s
    eff = TP2.efficiency
    ratio = (h20.intra_node_bandwidth * eff.interconnect) / (h20.network_bandwidth * eff.network)
    assert (across - latency) == pytest.approx((inside - latency) * ratio)
    # A measured profile that priced no NVLink path keeps its one path either way.
    measured = TP2.model_copy(update={"pieces": TP2.pieces.model_copy(update={"kv_transfer_node": None})})
    assert t_kv(4096, measured, measured, same_node=True) == t_kv(4096, measured, measured)


def test_the_planner_fills_each_server_with_both_pools_in_their_ratio():
    engines = [Engine(f"p{i}", 2, "prefill") for i in range(4)] + [Engine(f"d{i}", 2, "decode") for i in range(4)]
    servers = place(engines, 8)
    assert len(set(servers.values())) == 2
    for node in set(servers.values()):
        on = [w for w, n in servers.items() if n == node]
        assert sorted(w[0] for w in on) == ["d", "d", "p", "p"], on
    # A 1:3 split puts one prefill engine beside three decode engines on each server.
    engines = [Engine(f"p{i}", 2, "prefill") for i in range(2)] + [Engine(f"d{i}", 2, "decode") for i in range(6)]
    servers = place(engines, 8)
    assert all(sum(1 for w, n in servers.items() if n == node and w[0] == "p") == 1 for node in set(servers.values()))
    # An engine wider than a server takes whole servers of its own; the next one starts a new one.
    servers = place([Engine("big", 16, "decode"), Engine("p0", 4, "prefill")], 8)
    assert servers == {"big": "node-0", "p0": "node-2"}


def test_routing_prices_a_remote_prefill_on_the_decode_engines_server_lower():
    task = PrefillTask("t", l_hist=0, l_total=3000, created_at=0.0)
    decode = WorkerView("d", TP4, node="node-0")
    near, far = WorkerView("p0", TP2, node="node-0"), WorkerView("p1", TP2, node="node-1")
    assert remote_work(task, near, decode) < remote_work(task, far, decode)
    assert remote_work(task, near, decode) == pytest.approx(TP2.t_pre(0, 3000) + t_kv(3000, TP2, TP4, True))
    unknown = WorkerView("p2", TP2)  # no server known: the NIC's price
    assert remote_work(task, unknown, WorkerView("d", TP4)) == remote_work(task, far, decode)


def test_the_simulator_places_its_engines_and_prices_their_pulls_by_the_path():
    sessions = [TraceSession(session_id=f"s{i}", arrival_s=i * 0.5, rounds=[TraceRound(input_tokens=2000,
                output_tokens=8)]) for i in range(4)]  # fmt: skip
    slo = SLO(10.0, 1.0)
    small = Simulation(SimConfig(decode=Pool(TP2, 2), prefill=Pool(TP2, 2), slo=slo, policy="disagg"), sessions)
    assert {w.candidate.node for w in small.workers.values()} == {"node-0"}
    large = Simulation(SimConfig(decode=Pool(TP2, 4), prefill=Pool(TP2, 4), slo=slo, policy="disagg"), sessions)
    assert len({w.candidate.node for w in large.workers.values()}) == 2
