"""Remote prefill only when enough of the prompt is uncached: llm-d's and vllm-router's rule. Pure.

* llm-d's prefix-based P/D decider (llm-d/llm-d-inference-scheduler, now llm-d-router;
  plugin ``prefix-based-pd-decider``,
  pkg/epp/framework/plugins/scheduling/profilehandler/disagg/prefix_based_pd_decider.go,
  v0.7+): after the decode pod is chosen, the request is disaggregated iff
  ``nonCachedTokens > 0 and input_tokens >= nonCachedTokens and input_tokens -
  matched_blocks x block_size >= nonCachedTokens``; otherwise the decode pod's sidecar
  prefills locally. Its code default 0 disables disaggregation; its shipped sample
  configurations use 16 (deploy/config/pd-epp-config.yaml) and 8.
* vllm-router's ``pd_uncached_token_threshold`` (vllm-project/router, PR #130,
  docs/kv_events_pd_routing.md; default 256 tokens): the same family - straight to the
  decode worker when the best decode worker's uncached tokens (full blocks only) are
  below the threshold. It is documented and configurable but, as of that PR, not yet
  applied in the router's request path.

ampd's ``uncached-threshold`` is llm-d's comparison (``>=`` disaggregates) with
vllm-router's documented 256 tokens, since llm-d's 16 sends nearly every round of an
agent session remote (that is ``disagg``). The prompt is counted in real tokens
(llm-d estimates characters / 4), and the cached prefix is the session's history on its
decode worker in whole blocks (``RouteContext.decode_cached``; llm-d approximates it
from its own routing history, vllm-router from KV events). A remote prefill goes to the
prefill worker with the lowest Eq. 2 cost (llm-d and vllm-router score prefill workers
by prefix match and load).
"""

from __future__ import annotations

from dataclasses import dataclass

from rounds.routing import Route, RouteContext, local_cost, shortest_remote


@dataclass(frozen=True)
class UncachedThreshold:
    threshold: int = 256  # tokens; 0 never disaggregates (llm-d's convention)

    def __call__(self, ctx: RouteContext) -> Route:
        prompt = ctx.task.l_total
        uncached = prompt - ctx.decode_cached
        if self.threshold > 0 and prompt >= self.threshold and uncached >= self.threshold:
            return shortest_remote(ctx)
        return Route("local", ctx.decode.worker_id, "cached-prefix", local_cost(ctx.task, ctx.decode))
