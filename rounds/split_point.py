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

Alg. 1 balances T1 and T2 as if alpha and beta ran side by side. Inside a prompt they
cannot: beta's tokens attend to alpha's, so beta starts when alpha's KV has landed, and
a split round's prompt is done at max(T1(s), the decode engine's queue) + beta's compute
(``finish_time``). On idle engines that is always later than the better end, and
measured on ToolBench and HotpotQA at their knees (``ampd bench split``) Alg. 1's point
cost 0.7-38 points of SLO attainment against not splitting. So ``dynaserve`` splits by
that finish instead (``split_route``): the candidate split is the last point whose
hand-off lands as the decode engine's queue drains (``handoff_point``: beyond it every
token moved costs its compute on the prefill engine plus its transfer instead of its
compute on the decode engine), and the round goes to whichever of it, a local prefill
and a whole remote one finishes first - each charged the history its prefill engine
recomputes (``recompute_time``). That charge is not in the paper: a request of one round
has no history, and a round of a session does. A prefill engine that lacks the session's
history computes it again, work no engine does if the round stays local; judged by its
own finish alone, a round sends that work to the other engine whenever that finishes it
sooner, and at saturation every round queued behind it there pays for it: uncharged,
splits did worse than step sizing alone in simulation, charged better (``ampd bench
split``, docs/studies/split.md). Alg. 1 as printed stays as ``dynaserve-alg1``
(``alg1_route``), to compare with.

Split points are whole KV blocks: the decode engine pulls whole blocks. Where the engines
cannot run a split (one that does not register ``splits``: vLLM under its own connector,
which pulls whole prompts), the choice is among the two ends only: local or remote.

Not DynaServe's: splits inside the decode phase (alpha generating the first tokens) -
a session's decode stays on the engine it is bound to.
"""

from __future__ import annotations

from collections.abc import Callable

from rounds.routing import Route, RouteContext, WorkerView, local_cost, remote_compute, remote_costs, remote_work

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


def finish_time(ctx: RouteContext, prefill: WorkerView, s: int) -> float:
    """When the round's prompt is done if split at s: beta runs after alpha's hand-off has
    landed and after the decode engine's queue, max(T1(s), the queue) + beta's compute.
    s = l_hist has no alpha (a local prefill); s = l_total no beta to speak of."""
    task, decode = ctx.task, ctx.decode
    alpha_done = alpha_time(ctx, prefill, s) if s > task.l_hist else 0.0
    return max(alpha_done, decode.queue_cost) + decode.t_pre(s, task.l_total - s)


def recompute_time(ctx: RouteContext, prefill: WorkerView, s: int) -> float:
    """What a split at s (s = l_total: a whole remote prefill) spends recomputing history the
    decode engine holds: the prefill engine's compute of [0, s) less what it would be had it
    held the session's history. 0 for a local prefill, and for a prefill engine that served
    the session's last round."""
    task = ctx.task
    if s <= task.l_hist:
        return 0.0
    return max(0.0, remote_compute(task, prefill, s) - prefill.t_pre(task.l_hist, s - task.l_hist))


def balance_point(ctx: RouteContext, prefill: WorkerView) -> int:
    """Alg. 1: the split point s in [l_hist, l_total] that balances T1 and T2, in whole
    blocks; l_hist means local, l_total a whole remote prefill."""
    task, block = ctx.task, ctx.block_size
    lo, hi = task.l_hist, task.l_total
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


def handoff_point(ctx: RouteContext, prefill: WorkerView) -> int:
    """The last split point, in whole blocks, whose hand-off lands by the time the decode
    engine's queue drains (T1(s) <= its queue); l_hist when less than a block makes it.
    Before it beta waits on the queue anyway; past it beta waits on alpha."""
    task, block, queue = ctx.task, ctx.block_size, ctx.decode.queue_cost
    lo, hi = task.l_hist // block, (task.l_total - 1) // block  # the last token stays with beta
    while lo < hi:  # T1 grows with s: bisect for the last block boundary within the queue
        mid = (lo + hi + 1) // 2
        if alpha_time(ctx, prefill, mid * block) <= queue:
            lo = mid
        else:
            hi = mid - 1
    s = lo * block
    return s if s - task.l_hist >= block else task.l_hist


def _route(ctx: RouteContext, choose: Callable[[RouteContext, WorkerView, bool], int]) -> Route:
    """The round's route once ``choose`` has picked s for the cheapest prefill engine (Eq. 2)."""
    cost, prefill = min(zip(remote_costs(ctx), ctx.prefills, strict=True), key=lambda pair: pair[0])
    s = choose(ctx, prefill, ctx.decode.splits and prefill.splits)
    if s <= ctx.task.l_hist:
        return Route("local", ctx.decode.worker_id, "split", local_cost(ctx.task, ctx.decode))
    if s >= ctx.task.l_total:
        return Route("remote", prefill.worker_id, "split", cost)
    return Route("remote", prefill.worker_id, "split", alpha_time(ctx, prefill, s), split_at=s)


def _soonest(ctx: RouteContext, prefill: WorkerView, splits: bool) -> int:
    ends = (ctx.task.l_total, ctx.task.l_hist)  # on a tie, no split: it occupies two engines
    candidates = (*ends, handoff_point(ctx, prefill)) if splits else ends
    return min(candidates, key=lambda s: finish_time(ctx, prefill, s) + recompute_time(ctx, prefill, s))


def _alg1(ctx: RouteContext, prefill: WorkerView, splits: bool) -> int:
    if not splits:  # the ends only: the one that finishes both engines' work first
        ends = (ctx.task.l_total, ctx.task.l_hist)
        return min(ends, key=lambda s: max(alpha_time(ctx, prefill, s), beta_time(ctx, s)))
    return balance_point(ctx, prefill)


def split_route(ctx: RouteContext) -> Route:
    """``dynaserve``: the round's prompt done soonest - split at ``handoff_point`` between
    the cheapest prefill engine (Eq. 2) and the session's decode engine, prefilled
    locally, or sent whole - by ``finish_time`` plus ``recompute_time``."""
    return _route(ctx, _soonest)


def alg1_route(ctx: RouteContext) -> Route:
    """``dynaserve-alg1``: Alg. 1 as printed - the prompt split where T1 and T2 balance."""
    return _route(ctx, _alg1)
