"""Where a deployment's engines sit: servers of ``gpus_per_node`` GPUs. Pure.

KV moves between engines of one server over its GPU interconnect (NVLink) and between
servers over each rank's NIC (perfmodel.profile.t_kv), several times slower. So the
planner fills each server with prefill and decode engines in the deployment's own ratio
- engines taken from the pools in turn, each pool at its share - and places them first
fit, none split across servers unless its TP degree is larger than a server: then it
takes whole servers of its own. A round whose prefill and decode engines share a server
then pays the interconnect for its KV, and routing (rounds.routing, Eq. 2) sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    worker_id: str
    tp: int  # GPUs it takes
    pool: str  # "prefill", "decode", ...: engines of one pool are spread alike


def interleaved(engines: Sequence[Engine]) -> list[Engine]:
    """The engines in the order they are placed: each pool's in its own order, the pools
    taken in turn by how far behind their share of the placed GPUs they are."""
    pools: dict[str, list[Engine]] = {}
    for e in engines:
        pools.setdefault(e.pool, []).append(e)
    total = {name: sum(e.tp for e in group) for name, group in pools.items()}
    placed = dict.fromkeys(pools, 0)
    order = []
    while any(pools.values()):
        name = min((n for n in pools if pools[n]), key=lambda n: (placed[n] / total[n], n))
        engine = pools[name].pop(0)
        placed[name] += engine.tp
        order.append(engine)
    return order


def place(engines: Sequence[Engine], gpus_per_node: int) -> dict[str, str]:
    """The server (``node-<i>``) each engine sits on."""
    nodes: list[int] = []  # free GPUs per server so far
    out = {}
    for e in interleaved(engines):
        if e.tp > gpus_per_node:  # whole servers of its own; named by the first
            out[e.worker_id] = f"node-{len(nodes)}"
            nodes += [0] * -(-e.tp // gpus_per_node)
            continue
        fits = next((i for i, free in enumerate(nodes) if free >= e.tp), None)
        if fits is None:
            nodes.append(gpus_per_node)
            fits = len(nodes) - 1
        nodes[fits] -= e.tp
        out[e.worker_id] = f"node-{fits}"
    return out
