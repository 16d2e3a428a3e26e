"""Scheduling policies behind one switch: AMPD, its ablations, and the baselines.

Every policy is a routing rule plus a queue discipline over the same engines:
``ampd`` (Alg. 1 + Alg. 2), ``disagg`` (every prefill
remote, FIFO: the Dynamo baseline), ``coloc`` (every prefill on the engine that
decodes, FIFO: the vLLM baseline), ``continuum`` (colocated, a session's continuing
rounds first: vLLM-Continuum), ``ampd-routing-only`` and ``ampd-reorder-only``.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.reordering import Decision, QueuedTask, reorder
from gateway.routing import Route, RouteContext, adaptive_route, local_cost, shortest_remote

Routing = Literal["adaptive", "remote", "local"]
Queueing = Literal["fifo", "reorder", "session-priority"]

SESSION_PRIORITY_WINDOW = 64  # how far down the queue a continuing round is looked for


@dataclass(frozen=True)
class Policy:
    name: str
    routing: Routing
    queueing: Queueing
    uses_prefill_workers: bool = True

    def window(self, w: int) -> int:
        """How many head tasks a dispatch looks at."""
        return {"fifo": 1, "reorder": w, "session-priority": SESSION_PRIORITY_WINDOW}[self.queueing]


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in [
        Policy("ampd", "adaptive", "reorder"),
        Policy("disagg", "remote", "fifo"),
        Policy("coloc", "local", "fifo", uses_prefill_workers=False),
        Policy("continuum", "local", "session-priority", uses_prefill_workers=False),
        Policy("ampd-routing-only", "adaptive", "fifo"),
        Policy("ampd-reorder-only", "remote", "reorder"),
    ]
}


def route(policy: Policy, ctx: RouteContext) -> Route:
    """Where ``ctx.task`` prefills. Without prefill workers every policy prefills locally."""
    if policy.routing == "local" or not ctx.prefills or not policy.uses_prefill_workers:
        return Route("local", ctx.decode.worker_id, "policy", local_cost(ctx.task, ctx.decode))
    if policy.routing == "remote":
        return shortest_remote(ctx)
    return adaptive_route(ctx)


def pick(policy: Policy, window: Sequence[QueuedTask], now: float, w: int) -> Decision:
    """Which queued task runs next, as an order over the head ``window``."""
    if policy.queueing == "reorder":
        return reorder(window, now, cap=w)
    first = 0
    if policy.queueing == "session-priority":
        first = next((i for i, task in enumerate(window) if task.incremental), 0)
    rest = tuple(i for i in range(len(window)) if i != first)
    return Decision((first, *rest), postponed=tuple(range(first)), satisfied=0)
