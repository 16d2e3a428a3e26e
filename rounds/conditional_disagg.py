"""NVIDIA Dynamo's conditional disaggregation, as a routing rule. Pure: no I/O.

Dynamo's router (``--router-conditional-disagg``; ai-dynamo/dynamo,
lib/kv-router/src/conditional_disagg.rs and
lib/llm/src/kv_router/prefill_router/conditional_bypass.rs; documented under
advanced-customizations/conditional-disaggregation, Dynamo 1.5-1.6) first picks a
request's decode worker, then decides whether the request *bypasses* remote prefill
and prefills locally on that worker:

    eff_isl = prompt - min(decode_cached, prompt)      # what the decode worker lacks
    isl_bounding:  eff_isl < eff_isl_threshold  and  eff_isl / max(prompt, 1) < eff_isl_ratio_threshold
    prefill_load:  the prefill worker Dynamo's prefill router would pick is busy:
                   its active prefill tokens > prefill_busy_threshold x its max_num_batched_tokens
    isl_or_load:   isl_bounding or prefill_load

(all comparisons strict). Otherwise the prefill router picks a prefill worker and the
request runs disaggregated. Shipped defaults (``--router-conditional-disagg-config``):
policy ``isl_bounding``, eff_isl_threshold 2048 tokens, eff_isl_ratio_threshold 0.7, no
decode gate. The load policies need ``prefill_busy_threshold`` (or the router's queue
threshold) set - Dynamo 1.6.1 ships none and refuses to start without one - so ampd
takes 1.0: busy while more than one full step of prefill tokens waits or runs there.

How ampd maps Dynamo's inputs:

* the decode worker is the session's bound one: it holds the session's whole history,
  which is what Dynamo's cache-aware decode choice finds for a multi-round session;
* ``decode_cached`` is that history in whole KV blocks (``RouteContext.decode_cached``:
  KV events report whole blocks of a contiguous prefix);
* the prefill worker its prefill router would pick is the one with the lowest Eq. 2 cost
  (its own prefix cache of the session and its queue), which then also runs the remote
  prefill;
* a worker's active prefill tokens are those of the prefills queued in ampd's prefill
  queue for it or running on it.

Left out: the optional decode gate (``decode_busy_threshold``, off by default),
Dynamo's weighting of host- and disk-tier cache hits (ampd sees the device cache only),
and its second decode choice after a remote prefill (ampd keeps the session's binding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rounds.routing import Route, RouteContext, local_cost, remote_costs, shortest_remote

DynamoPolicy = Literal["isl_bounding", "prefill_load", "isl_or_load"]


@dataclass(frozen=True)
class ConditionalDisagg:
    policy: DynamoPolicy = "isl_bounding"
    eff_isl_threshold: int = 2048
    eff_isl_ratio_threshold: float = 0.7
    prefill_busy_threshold: float = 1.0

    def short_isl(self, ctx: RouteContext) -> bool:
        prompt = ctx.task.l_total
        eff_isl = prompt - min(ctx.decode_cached, prompt)
        return eff_isl < self.eff_isl_threshold and eff_isl / max(prompt, 1) < self.eff_isl_ratio_threshold

    def prefill_busy(self, ctx: RouteContext) -> bool:
        costs = remote_costs(ctx)
        chosen = ctx.prefills[costs.index(min(costs))]
        return chosen.active_tokens > self.prefill_busy_threshold * chosen.token_budget

    def __call__(self, ctx: RouteContext) -> Route:
        reasons = {
            "isl_bounding": [("short-isl", self.short_isl)],
            "prefill_load": [("prefill-busy", self.prefill_busy)],
            "isl_or_load": [("short-isl", self.short_isl), ("prefill-busy", self.prefill_busy)],
        }[self.policy]
        for reason, bypass in reasons:
            if bypass(ctx):
                return Route("local", ctx.decode.worker_id, reason, local_cost(ctx.task, ctx.decode))
        return shortest_remote(ctx)
