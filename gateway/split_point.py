"""Where a prompt is split between a prefill engine and the session's decode engine. Pure: no I/O.

"DynaServe: Unified and Elastic Execution for Dynamic Disaggregated LLM Serving",
section 4.1, Alg. 1 (the global request scheduler): a request is cut at a split point
s into two micro-requests - alpha, tokens before s, on one engine, and beta, the rest,
on another that pulls alpha's KV - and s is found by a bounded binary search that
starts from plain disaggregation and balances the two engines' predicted execution
times T1 and T2 under their current loads. s = L is disaggregation, s = 0 colocation.

For a multi-round session the beta engine is the one the session is bound to, and the
split falls inside the round's prompt: the prefill engine computes tokens [0, s) less
its own prefix-cache hits and holds them, the decode engine pulls [l_hist, s) - it
holds the history already - and prefills [s, l_total) itself beside its decodes:

* T1(s): the prefill engine's queue, its compute of alpha, and the hand-off of the
  tokens the decode engine lacks (Eq. 2 of the AMPD paper for a prompt of s tokens);
* T2(s): the decode engine's prefill queue and its compute of beta (Eq. 1 for the
  tokens after s).

T1 grows with s and T2 falls, so the search converges on the balance. Split points are
whole KV blocks: the decode engine pulls whole blocks. A split the engines cannot run
(an engine that is not the GPU-free one: vLLM's connector pulls whole prompts) is
searched among the two ends only: local or remote.

Not DynaServe's: splits inside the decode phase (alpha generating the first tokens) -
a session's decode stays on the engine it is bound to.
"""

from __future__ import annotations

from gateway.routing import Route, RouteContext, WorkerView, local_cost, remote_costs, remote_work

SEARCH_STEPS = 6  # Alg. 1's K ("typically set to 6")
BALANCED_S = 1e-3  # Alg. 1's epsilon: predicted times this close are balanced


def alpha_time(ctx: RouteContext, prefill: WorkerView, s: int) -> float:
    """T1: the prefill engine's queue, then tokens [0, s) less its cache, then the hand-off
    of [l_hist, s) to the decode engine; only the queue when s leaves it nothing new."""
    if s <= ctx.task.l_hist:
        return prefill.queue_cost
    return prefill.queue_cost + remote_work(ctx.task, prefill, ctx.decode, s)


def beta_time(ctx: RouteContext, s: int) -> float:
    """T2: the decode engine's prefill queue, then tokens [s, l_total) on it."""
    return ctx.decode.queue_cost + ctx.decode.t_pre(s, ctx.task.l_total - s)


def split_point(ctx: RouteContext, prefill: WorkerView, splits: bool = True) -> int:
    """Alg. 1: the split point s in [l_hist, l_total] that balances T1 and T2, in whole
    blocks; l_hist means local, l_total a whole remote prefill."""
    task, block = ctx.task, ctx.block_size
    lo, hi = task.l_hist, task.l_total
    if not splits:  # the ends only: the one that finishes both engines' work first
        return min((hi, lo), key=lambda s: max(alpha_time(ctx, prefill, s), beta_time(ctx, s)))
    s = hi  # line 3: start from disaggregation
    for _ in range(SEARCH_STEPS):
        t1, t2 = alpha_time(ctx, prefill, s), beta_time(ctx, s)
        if abs(t1 - t2) <= BALANCED_S:
            break
        if t1 < t2:  # the prefill engine would idle first: give it more
            if s == task.l_total:
                break
            lo = s
        else:
            hi = s
        mid = (lo + hi) // 2 // block * block
        if mid <= lo or mid >= hi:  # within a block of the balance
            s = lo if mid <= lo else hi
            break
        s = mid
    return s if s - task.l_hist >= block or s == task.l_total else task.l_hist


def split_route(ctx: RouteContext) -> Route:
    """``dynaserve``: the prompt split at Alg. 1's point between the cheapest prefill engine
    (Eq. 2) and the session's decode engine; the ends are a local or a whole remote prefill."""
    cost, prefill = min(zip(remote_costs(ctx), ctx.prefills, strict=True), key=lambda pair: pair[0])
    s = split_point(ctx, prefill, ctx.decode.splits and prefill.splits)
    if s <= ctx.task.l_hist:
        return Route("local", ctx.decode.worker_id, "split", local_cost(ctx.task, ctx.decode))
    if s >= ctx.task.l_total:
        return Route("remote", prefill.worker_id, "split", cost)
    return Route("remote", prefill.worker_id, "split", alpha_time(ctx, prefill, s), split_at=s)
