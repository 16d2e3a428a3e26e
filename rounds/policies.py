"""Scheduling policies behind one switch: AMPD, its ablations, and the baselines.

Every policy is a routing rule plus a queue discipline over the same engines. Pure: no I/O.

* ``ampd``: Alg. 1 (rounds.routing) and Alg. 2 (rounds.reordering);
  ``ampd-routing-only`` and ``ampd-reorder-only`` keep one of the two; ``ampd-tail``
  judges a local prefill's stall under the tail ITL rules (rounds.routing);
* ``disagg``: every prefill remote, FIFO (Dynamo's plain disaggregation);
* ``coloc``: every prefill on the engine that decodes, FIFO (vLLM);
  ``continuum``: colocated, a session's continuing rounds first (vLLM-Continuum);
* ``dynamo-conditional``: Dynamo's conditional disaggregation with its shipped default
  policy (isl_bounding), and ``dynamo-conditional-load`` / ``dynamo-conditional-isl-or-load``
  with its other two (rounds.conditional_disagg);
* ``uncached-threshold``: llm-d's prefix-based P/D decider / vllm-router's uncached-token
  threshold (rounds.uncached_threshold);
* ``elastic``: engines change role with the load (rounds.elastic: Arrow's SLO-driven
  moves and DOPD's forecast-driven split), rounds routed as ``ampd-tail`` within the
  current roles; ``elastic-arrow`` and ``elastic-dopd`` keep one source of moves;
* ``dynaserve``: DynaServe's micro-requests on a pool of unified engines - every engine
  decodes its sessions and prefills others' - each prompt split between the cheapest
  other engine and the session's where that finishes the prompt soonest
  (rounds.split_point), and the engines' steps sized to the ITL rule
  (``slo_batching``); ``dynaserve-split-only`` and ``dynaserve-batching-only`` keep one
  of the two; ``dynaserve-alg1`` splits at DynaServe's Alg. 1 point as printed;
  ``elastic-split``: the elastic roles with the same split as ``dynaserve``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from perfmodel.slo import BETA, SLO, ItlRule
from rounds.conditional_disagg import ConditionalDisagg
from rounds.elastic import ElasticConfig
from rounds.reordering import Decision, QueuedTask, reorder
from rounds.routing import Route, RouteContext, adaptive_route, local_only, shortest_remote, tail_aware_route
from rounds.split_point import alg1_route, split_route
from rounds.uncached_threshold import UncachedThreshold

Queueing = Literal["fifo", "reorder", "session-priority"]

SESSION_PRIORITY_WINDOW = 64  # how far down the queue a continuing round is looked for


@dataclass(frozen=True)
class Policy:
    name: str
    rule: Callable[[RouteContext], Route]  # where a task prefills when prefill workers are there
    queueing: Queueing
    uses_prefill_workers: bool = True
    elastic: ElasticConfig | None = None  # engines change role with the load (rounds.elastic)
    unified: bool = False  # on a pool, every engine both decodes and prefills others' prompts
    slo_batching: bool = False  # engines size their steps to the ITL rule (step_target)

    @property
    def on_pool(self) -> bool:
        """It runs on one pool of engines (``--pool TPxN``) rather than prefill and decode pools."""
        return self.elastic is not None or self.unified

    def window(self, w: int) -> int:
        """How many head tasks a dispatch looks at."""
        return {"fifo": 1, "reorder": w, "session-priority": SESSION_PRIORITY_WINDOW}[self.queueing]


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in [
        Policy("ampd", adaptive_route, "reorder"),
        Policy("disagg", shortest_remote, "fifo"),
        Policy("coloc", local_only, "fifo", uses_prefill_workers=False),
        Policy("continuum", local_only, "session-priority", uses_prefill_workers=False),
        Policy("ampd-routing-only", adaptive_route, "fifo"),
        Policy("ampd-reorder-only", shortest_remote, "reorder"),
        Policy("ampd-tail", tail_aware_route, "reorder"),
        Policy("dynamo-conditional", ConditionalDisagg("isl_bounding"), "fifo"),
        Policy("dynamo-conditional-load", ConditionalDisagg("prefill_load"), "fifo"),
        Policy("dynamo-conditional-isl-or-load", ConditionalDisagg("isl_or_load"), "fifo"),
        Policy("uncached-threshold", UncachedThreshold(256), "fifo"),
        Policy("elastic", tail_aware_route, "reorder", elastic=ElasticConfig()),
        Policy("elastic-arrow", tail_aware_route, "reorder", elastic=ElasticConfig(dopd=False, planned=False)),
        Policy("elastic-dopd", tail_aware_route, "reorder", elastic=ElasticConfig(arrow=False, planned=False)),
        Policy("dynaserve", split_route, "fifo", unified=True, slo_batching=True),
        Policy("dynaserve-split-only", split_route, "fifo", unified=True),
        Policy("dynaserve-alg1", alg1_route, "fifo", unified=True, slo_batching=True),
        Policy("dynaserve-batching-only", local_only, "fifo", unified=True, slo_batching=True),
        Policy("elastic-split", split_route, "reorder", elastic=ElasticConfig(), slo_batching=True),
    ]
}


def route(policy: Policy, ctx: RouteContext) -> Route:
    """Where ``ctx.task`` prefills. Without prefill workers every policy prefills locally."""
    if not ctx.prefills or not policy.uses_prefill_workers:
        return local_only(ctx)
    return policy.rule(ctx)


def pick(policy: Policy, window: Sequence[QueuedTask], now: float, w: int) -> Decision:
    """Which queued task runs next, as an order over the head ``window``."""
    if policy.queueing == "reorder":
        return reorder(window, now, cap=w)
    first = 0
    if policy.queueing == "session-priority":
        first = next((i for i, task in enumerate(window) if task.incremental), 0)
    rest = tuple(i for i in range(len(window)) if i != first)
    return Decision((first, *rest), postponed=tuple(range(first)), satisfied=0)


def step_target(policy: Policy, slo: SLO, rule: ItlRule, beta: float) -> float:
    """The step time an engine's batches keep to while it decodes (SchedulerConfig.step_target_s),
    0 for none. DynaServe's local scheduler keeps every step under the TBT SLO (section 4.2);
    that is what the tail rules judge. Under the mean rule one long step barely moves a
    round's mean gap, so engines batch as vLLM does."""
    if not policy.slo_batching or rule == "mean":
        return 0.0
    return beta * slo.itl_s


def step_target_ms(policy: str, slo: SLO, rule: ItlRule, beta: float = BETA) -> float:
    """:func:`step_target` of the policy named ``policy``, in milliseconds, as engines take it
    (``--step-target-ms``); 0 for a name that is no policy (whoever parses it refuses it)."""
    return 1000 * step_target(POLICIES[policy], slo, rule, beta) if policy in POLICIES else 0.0
