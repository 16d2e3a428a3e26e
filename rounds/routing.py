"""Where a prefill runs: AMPD's adaptive routing (Alg. 1 with Eq. 1-2). Pure: no I/O.

"Efficient Multi-round LLM Inference over Disaggregated Serving" (AMPD), section 4.1. A
prefill task of a session bound to decode worker d either runs *locally* on d, whose
prefix cache holds the session's history, or *remotely* on a prefill worker, whose
output KV d then pulls.

Eq. 2 is modelled as vLLM's NixlConnector protocol really behaves (the paper assumes
a prefill worker can read the history KV from d; vLLM's cannot):

* the prefill worker computes everything it does not hold in its own prefix cache -
  for a session it served before, the prompt of that round - so
  t_pre_i = T_pre(h_i, l_total - h_i; theta_pi) with h_i its cached tokens;
* d then pulls only the blocks it lacks: t_kv_i = T_kv(l_total - l_hist; theta_pi, theta_d);
* t_queue_i is the estimated prefill time of everything queued on i.

Costs come from each worker's profile divided by its ``speed`` (a GPU-free worker
may run faster than the GPU it models), so they compare with wall-clock statistics.
Every rule takes one :class:`RouteContext`: the task, the workers as routing sees them,
the SLO and the knobs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from perfmodel.profile import Profile, t_kv
from perfmodel.slo import ALPHA, BETA, SLO, ItlRule


@dataclass(frozen=True)
class PrefillTask:
    """One prefill: the first of a session (l_hist = 0) or an incremental one."""

    task_id: str
    l_hist: int  # tokens of this session the bound decode worker already holds
    l_total: int  # prompt tokens of this round
    created_at: float  # when the round's TTFT clock started

    @property
    def l_incr(self) -> int:
        return self.l_total - self.l_hist

    @property
    def incremental(self) -> bool:
        return self.l_hist > 0


@dataclass(frozen=True)
class WorkerView:
    """What routing knows of one worker at decision time."""

    worker_id: str
    profile: Profile
    speed: float = 1.0
    windowed_ttft: float | None = None  # mean over the statistics window; None if no samples
    windowed_itl: float | None = None
    queue_cost: float = 0.0  # estimated seconds of prefill queued on this worker (wall clock)
    cached_tokens: int = 0  # this session's tokens in this worker's prefix cache (prefill workers)
    active_tokens: int = 0  # prompt tokens it has to compute for prefills queued or running on it
    token_budget: int = 8192  # tokens it schedules per step (vLLM's max_num_batched_tokens)
    prefill_chunk: int = 0  # tokens of one request it prefills a step at most (0: all at once)
    splits: bool = True  # it runs split requests (rounds.split_point): the GPU-free engine, vLLM under ampd's connector
    node: str = ""  # the server it sits on ("": unknown)
    # What its own scheduler found its prefill steps take against the profile's price
    # (perfmodel.step_correction, measured / predicted): an engine's profile is priced as
    # the engine itself prices it.
    prefill_factor: float = 1.0

    def same_node(self, other: WorkerView) -> bool:
        """Whether KV between the two moves within one server (over its GPU interconnect)."""
        return self.node != "" and self.node == other.node

    def t_pre(self, l_hist: int, l_incr: int) -> float:
        return self.profile.t_pre_chunked(l_hist, l_incr, self.prefill_chunk) * self.prefill_factor / self.speed

    def longest_step(self, l_hist: int, l_incr: int) -> float:
        """The longest step a prefill of ``l_incr`` tokens takes here: the stall it adds to
        every stream decoding on this worker meanwhile."""
        return self.profile.t_pre(l_hist, min(l_incr, self.prefill_chunk or l_incr)) * self.prefill_factor / self.speed


@dataclass(frozen=True)
class RouteContext:
    """Everything a routing rule may look at for one task (one object, as llm-d's plugins take)."""

    task: PrefillTask
    decode: WorkerView  # the session's decode worker
    prefills: Sequence[WorkerView]  # prefill workers it may use (none: local only)
    slo: SLO
    alpha: float = ALPHA  # Alg. 1's TTFT slack factor
    beta: float = BETA  # Alg. 1's ITL slack factor
    rng: random.Random = field(default_factory=random.Random)
    block_size: int = 16  # tokens per KV block: prefix caches hit whole blocks
    itl_rule: ItlRule = "mean"  # how rounds are judged (perfmodel.slo): tail-aware rules read it

    @property
    def decode_cached(self) -> int:
        """The session's tokens the decode worker's prefix cache holds for this prompt:
        its history in whole blocks, at most all tokens but the last (as vLLM matches)."""
        whole = self.task.l_hist // self.block_size * self.block_size
        return min(whole, self.task.l_total - 1)


@dataclass(frozen=True)
class Route:
    kind: Literal["local", "remote"]
    worker_id: str
    reason: str  # why: ttft-slack, itl-slack or cost (Alg. 1), policy, or a production rule's (see its module)
    estimate_s: float | None = None  # Eq. 1 or 2, when it was computed
    # A remote route's split point (rounds.split_point): the prefill worker computes the
    # prompt's first ``split_at`` tokens, the decode worker the rest. None: the whole prompt.
    split_at: int | None = None


def local_compute(task: PrefillTask, decode: WorkerView) -> float:
    """The increment prefilled on the bound decode worker, whose cache holds the history."""
    return decode.t_pre(task.l_hist, task.l_incr)


def remote_compute(task: PrefillTask, prefill: WorkerView, end: int | None = None) -> float:
    """What a prefill worker computes: the prompt (its first ``end`` tokens, a split's) less
    what its own prefix cache holds."""
    end = task.l_total if end is None else end
    cached = min(prefill.cached_tokens, end - 1)
    return prefill.t_pre(cached, end - cached)


def local_cost(task: PrefillTask, decode: WorkerView) -> float:
    """Eq. 1: prefill the increment on the bound decode worker, after its queue."""
    return local_compute(task, decode) + decode.queue_cost


def remote_work(task: PrefillTask, prefill: WorkerView, decode: WorkerView, end: int | None = None) -> float:
    """Eq. 2 without the queue: compute what i lacks, and d pulls what it lacks (vLLM's protocol)
    - of the prompt, or of its first ``end`` tokens (a split's first part)."""
    end = task.l_total if end is None else end
    transfer = t_kv(end - task.l_hist, prefill.profile, decode.profile, prefill.same_node(decode))
    transfer /= min(prefill.speed, decode.speed)
    return remote_compute(task, prefill, end) + transfer


def remote_cost(task: PrefillTask, prefill: WorkerView, decode: WorkerView) -> float:
    """Eq. 2 as vLLM's protocol allows: compute what i lacks, d pulls what it lacks, plus i's queue."""
    return remote_work(task, prefill, decode) + prefill.queue_cost


def remote_costs(ctx: RouteContext) -> list[float]:
    """Eq. 2 for each of ``ctx.prefills``, in order. Workers that differ only in their
    queues share one computation of the rest: a pool of identical replicas (a planned
    cluster's tens of them, every round) prices its prompt once."""
    known: dict[tuple[int, float, float, int, int], float] = {}
    costs = []
    for p in ctx.prefills:
        key = (id(p.profile), p.speed, p.prefill_factor, min(p.cached_tokens, ctx.task.l_total - 1), p.prefill_chunk)
        if key not in known:
            known[key] = remote_work(ctx.task, p, ctx.decode)
        costs.append(known[key] + p.queue_cost)
    return costs


def adaptive_route(ctx: RouteContext, stalls: bool = False) -> Route:
    """AMPD Alg. 1.

    Lines 1-3 take a prefill worker with TTFT slack; the paper takes any (it shuffles).
    Under vLLM's protocol a prefill worker without the session's prefix recomputes the
    whole history, so among the workers with slack we take the cheapest by Eq. 2 - in
    practice the one that served the session's last remote round - and shuffle only to
    break ties: taking any worker with slack sends rounds to workers that recompute the
    history, and fell far below disagg in simulation (docs/studies/policies.md).

    Slack is judged on the windowed statistics *and* on the task's own estimate: a
    prefill worker has TTFT slack only if Eq. 2 (its queue included) is within
    alpha * TTFT_thres too, and d only if Eq. 1 is. The windowed TTFT describes rounds
    that finished; when a burst queues up, it still shows slack for seconds, every
    task herds onto the same workers, and their TTFT collapses (simulated: mean TTFT
    of "slack" rounds 9.2 s against a 5.5 s SLO). Local prefills likewise take one slot
    of d at a time, so d's ITL barely moves while its queue grows.

    With ``stalls`` (``tail_aware_route``), a local prefill must also fit its longest step
    - the stall every stream decoding on d sees meanwhile - within beta * ITL_thres, in
    lines 4-5 and in lines 6-9 alike; the windowed mean ITL cannot see a stall that one
    round in twenty suffers, and the tail rules judge exactly those.
    """
    task, decode, budget = ctx.task, ctx.decode, ctx.alpha * ctx.slo.ttft_s
    remote = list(zip(remote_costs(ctx), ctx.prefills, strict=True))
    slack = [(cost, p) for cost, p in remote if (p.windowed_ttft or 0.0) <= budget and cost <= budget]
    if slack:  # lines 1-3
        ctx.rng.shuffle(slack)
        cost, chosen = min(slack, key=lambda pair: pair[0])
        return Route("remote", chosen.worker_id, "ttft-slack", cost)
    local = local_cost(task, decode)
    fits = not stalls or decode.longest_step(task.l_hist, task.l_incr) <= ctx.beta * ctx.slo.itl_s
    if fits and (decode.windowed_itl or 0.0) <= ctx.beta * ctx.slo.itl_s and local <= budget:  # lines 4-5
        return Route("local", decode.worker_id, "itl-slack", local)
    best = Route("local", decode.worker_id, "cost", local) if fits else None  # lines 6-9
    for cost, p in remote:
        if best is None or cost < best.estimate_s:
            best = Route("remote", p.worker_id, "cost" if fits else "stall", cost)
    assert best is not None  # route() sends a task with no prefill worker local before
    return best


def tail_aware_route(ctx: RouteContext) -> Route:
    """Alg. 1 for the ITL rule in force (``ampd-tail``): as published under the mean rule;
    under the P95 and longest-gap rules, local prefills only where their stall fits."""
    return adaptive_route(ctx, stalls=ctx.itl_rule != "mean")


def local_only(ctx: RouteContext) -> Route:
    """Every prefill on the decode worker (the colocated baselines)."""
    return Route("local", ctx.decode.worker_id, "policy", local_cost(ctx.task, ctx.decode))


def shortest_remote(ctx: RouteContext) -> Route:
    """Always remote, to the prefill worker with the lowest Eq. 2 cost (the disaggregated baseline)."""
    costs = [(cost, p.worker_id) for cost, p in zip(remote_costs(ctx), ctx.prefills, strict=True)]
    cost, worker_id = min(costs)
    return Route("remote", worker_id, "policy", cost)
